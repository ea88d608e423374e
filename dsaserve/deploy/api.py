"""The planner as JSON: one function behind both `dsaserve plan --json` and `POST /api/plan` (so
the two cannot drift), the option tables the web console offers, and the refusal matrix it uses
to grey options out."""

from __future__ import annotations

import dataclasses
import itertools
import re
import typing
from typing import Any, NamedTuple

from dsaserve.deploy import layout
from dsaserve.deploy.hardware import HARDWARE, PlanError
from dsaserve.deploy.layout import RECIPES, PlanRequest, Refusal
from dsaserve.deploy.models import BUILTIN_MODELS
from dsaserve.deploy.planner import AUTO_NODES, RULES, nearest, plan

FIELDS = {f.name: f for f in dataclasses.fields(PlanRequest)}
_HINTS = typing.get_type_hints(PlanRequest)
_FLAG = re.compile(r"--([a-z][a-z-]*)")
MATRIX_AXES = ("model", "hardware", "recipe", "nodes")
MATRIX_NODES = (None, *AUTO_NODES)  # None: the fewest that fit


class FieldError(PlanError):
    """An unknown option name or a value of the wrong type; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"--{param.replace('_', '-')}: {message}")
        self.param = param


class Answer(NamedTuple):
    """What the planner answered: `exit_code` 0 planned, 1 refused, 2 unusable input."""

    exit_code: int
    body: dict[str, Any]

    @property
    def http_status(self) -> int:
        return 400 if self.exit_code == 2 else 200  # a refusal is an answer, not an error


def plan_answer(fields: dict[str, Any]) -> Answer:
    """Plan the request described by `fields` (PlanRequest's field names) into a JSON body."""
    try:
        request = PlanRequest(**check_fields(fields))
        result = plan(request)
    except PlanError as e:
        return Answer(2, invalid_body(str(e), getattr(e, "param", None)))
    except Refusal as refusal:
        near = nearest(request)
        body: dict[str, Any] = {"ok": False, "rule": refusal.rule, "reason": refusal.reason}
        body["nearest"] = {"plan": near.request.command(), **near.to_json()} if near else None
        return Answer(1, body)
    return Answer(0, result.to_json())


def invalid_body(message: str, param: str | None = None) -> dict[str, Any]:
    """Unusable input, in the OpenAI error envelope (plus `ok: false`)."""
    if param is None:
        match = _FLAG.search(message)
        name = match.group(1).replace("-", "_") if match else None
        param = name if name in FIELDS else None
    error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    return {"ok": False, "error": error}


def check_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Refuse unknown names and values of the wrong JSON type (PlanRequest checks the ranges)."""
    for name, value in fields.items():
        if name not in FIELDS:
            raise FieldError(name, "unknown planner option")
        if not _type_ok(_HINTS[name], value):
            raise FieldError(name, f"{value!r} has the wrong type")
    return fields


def _type_ok(hint: Any, value: Any) -> bool:
    allowed = typing.get_args(hint) or (hint,)
    if value is None:
        return type(None) in allowed
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int):
        return int in allowed or float in allowed
    return any(isinstance(value, t) for t in allowed if t in (str, float))


def coerce_query(params: dict[str, str]) -> dict[str, Any]:
    """Query-string values ("2", "true", "") to the field's type, for GET routes."""
    out: dict[str, Any] = {}
    for name, text in params.items():
        if name not in FIELDS:
            raise FieldError(name, "unknown planner option")
        allowed = typing.get_args(_HINTS[name]) or (_HINTS[name],)
        if text in ("", "none", "null") and type(None) in allowed:
            out[name] = None
        elif bool in allowed:
            out[name] = text.lower() in ("1", "true", "on", "yes")
        elif int in allowed or float in allowed:
            try:
                out[name] = int(text) if int in allowed else float(text)
            except ValueError:
                raise FieldError(name, f"{text!r} is not a number") from None
        else:
            out[name] = text
    return out


def plan_options() -> dict[str, Any]:
    """Models, hardware, recipes, feature choices, defaults and rule statements, from the
    planner's own tables."""
    models = [
        {"name": m.name, "base": _base_name(m.name, m.precision), "precision": m.precision,
         "model_path": m.model_path, "model_type": m.model_type, "has_mtp": m.has_mtp,
         "context_length": m.max_position_embeddings,
         "reasoning_parser": m.reasoning_parser, "tool_call_parser": m.tool_call_parser}
        for m in BUILTIN_MODELS.values()
    ]  # fmt: skip
    choices = {
        "pd": layout.PD_ROLES, "pd_transfer_backend": layout.PD_TRANSFER_BACKENDS,
        "speculative": layout.SPECULATIVE, "kv_cache_dtype": layout.KV_DTYPES,
        "context_parallel": layout.CP_STRATEGIES, "dp_attention": layout.DP_ATTENTION,
        "hicache_write_policy": layout.HICACHE_WRITE_POLICIES,
        "hicache_storage": layout.HICACHE_STORAGE,
    }  # fmt: skip
    return {
        "models": models,
        "hardware": [dataclasses.asdict(hw) for hw in HARDWARE.values()],
        "recipes": list(RECIPES),
        "nodes": list(AUTO_NODES),
        "choices": {name: list(values) for name, values in choices.items()},
        "defaults": dataclasses.asdict(PlanRequest()),
        "rules": [{"name": r.name, "text": r.text} for r in RULES],
    }


def _base_name(name: str, precision: str) -> str:
    suffix = "-" + precision.upper()
    return name[: -len(suffix)] if name.upper().endswith(suffix) else name


def plan_matrix(fixed: dict[str, Any]) -> dict[str, Any]:
    """ok, or the refusing rule and its reason, for every model x hardware x recipe x nodes, with
    the other options as in `fixed`."""
    fixed = {k: v for k, v in check_fields(fixed).items() if k not in MATRIX_AXES}
    PlanRequest(**fixed)  # bad options are refused once, not in every cell
    cells = []
    axes = (BUILTIN_MODELS, HARDWARE, RECIPES, MATRIX_NODES)
    for model, hardware, recipe, nodes in itertools.product(*axes):
        cell: dict[str, Any] = {"model": model, "hardware": hardware, "recipe": recipe}
        cell["nodes"] = nodes
        try:
            done = plan(PlanRequest(**fixed, model=model, hardware=hardware, recipe=recipe,
                                    nodes=nodes))  # fmt: skip
            cell.update(ok=True, nodes_planned=done.layout.nodes if done.layout else None)
        except Refusal as refusal:
            cell.update(ok=False, rule=refusal.rule, reason=refusal.reason)
        cells.append(cell)
    return {"axes": list(MATRIX_AXES), "fixed": fixed, "cells": cells}
