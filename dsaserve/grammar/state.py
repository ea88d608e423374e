"""One request's grammar: armed until the trigger token (`</think>`), then every token matched."""

from __future__ import annotations

from dsaserve.grammar.backend import Matcher


class GrammarState:
    """Follows a request's output; `active` while its next token must be masked."""

    def __init__(self, matcher: Matcher, after_token_id: int | None = None) -> None:
        self.matcher = matcher
        self.trigger = after_token_id
        self.armed = after_token_id is not None  # waiting for the trigger: output is free
        self.rejected = 0  # tokens the grammar refused (sampled without its mask: never, in use)

    @property
    def active(self) -> bool:
        return not self.armed and not self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        return not self.armed and self.matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        if self.armed:
            self.armed = token_id != self.trigger
        elif not self.matcher.is_terminated() and not self.matcher.accept(token_id):
            self.rejected += 1
