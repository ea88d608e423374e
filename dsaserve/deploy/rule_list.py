"""The rule machinery: a rule reads and edits a `Layout`, returns a short detail when it
applies (shown in the output under its name), None when it does not, or raises `Refuse`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dsaserve.deploy.layout import AppliedRule, Layout, Refusal


class Refuse(Exception):
    """Raised inside a rule; `apply_rules` turns it into a `Refusal` naming the rule."""


@dataclass(frozen=True)
class Rule:
    name: str
    text: str
    apply: Callable[[Layout], str | None]


class RuleList(list[Rule]):
    """Rules in the order they run; `@rules.rule(name, text)` appends one."""

    def rule(self, name: str, text: str) -> Callable:
        def register(fn: Callable[[Layout], str | None]) -> Callable[[Layout], str | None]:
            self.append(Rule(name, text, fn))
            return fn

        return register


def apply_rules(layout: Layout, rules: list[Rule]) -> Layout:
    """Run `rules` in order, recording those that apply; raise `Refusal` on the first veto."""
    for r in rules:
        try:
            detail = r.apply(layout)
        except Refuse as e:
            raise Refusal(r.name, str(e)) from None
        if detail is not None:
            layout.applied.append(AppliedRule(r.name, r.text, detail))
    return layout
