"""`/openapi.json`: every operation with its request body, generated from the same pydantic models
the routes validate with, so schema-driven fuzzers and client generators see what is accepted."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"
ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]},
    }}},
}  # fmt: skip
ERROR_STATUSES = {
    "400": "Invalid request", "401": "Missing or wrong API key", "404": "Not found",
    "413": "Body too large", "415": "Body is not JSON", "429": "Queue full",
    "503": "Starting, draining or engine unavailable",
}  # fmt: skip


def operation_extra(body: type[BaseModel] | None, path: str) -> dict:
    """The `openapi_extra` of one route: its JSON body (if any), path parameters, errors."""
    errors = {
        code: {"description": text, "content": {"application/json": {"schema": ERROR_SCHEMA}}}
        for code, text in ERROR_STATUSES.items()
    }
    extra: dict[str, Any] = {"responses": errors}
    names = re.findall(r"{(\w+)(?::\w+)?}", path)
    if names:
        extra["parameters"] = [{"name": name, "in": "path", "required": True,
                                "schema": {"type": "string"}} for name in names]  # fmt: skip
    if body is not None:
        schema = {"$ref": REF.format(model=body.__name__)}
        extra["requestBody"] = {"required": True,
                                "content": {"application/json": {"schema": schema}}}  # fmt: skip
    return extra


def build_openapi(app: FastAPI, bodies: list[type[BaseModel]]) -> dict:
    """The app's schema with every body model (and the models they use) under components."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in bodies:
            model_schema = model.model_json_schema(ref_template=REF)
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema
