"""One request's grammar: armed until the trigger token (`</think>`), then every token matched."""

from __future__ import annotations

from dsaserve.grammar.backend import Matcher
from dsaserve.grammar.thinking import ThinkingExits


class GrammarState:
    """Follows a request's output; `active` while its next token must be masked. While armed,
    `banned_now()` are the tokens that would end thinking anywhere but at the trigger."""

    def __init__(self, matcher: Matcher, after_token_id: int | None = None,
                 exits: ThinkingExits | None = None) -> None:  # fmt: skip
        self.matcher = matcher
        self.trigger = after_token_id
        self.armed = after_token_id is not None  # waiting for the trigger: output is free
        self.exits = exits if self.armed else None
        self.tail = b""  # the output's last bytes while armed (see ThinkingExits)
        self.rejected = 0  # tokens the grammar refused (sampled without its mask: never, in use)

    @property
    def active(self) -> bool:
        return not self.armed and not self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        return not self.armed and self.matcher.is_terminated()

    def banned_now(self) -> list[int]:
        return self.exits.banned(self.tail) if self.armed and self.exits is not None else []

    def accept(self, token_id: int) -> None:
        if self.armed:
            self.armed = token_id != self.trigger
            if self.exits is not None:
                self.tail = self.exits.tail(self.tail, token_id)
        elif not self.matcher.is_terminated() and not self.matcher.accept(token_id):
            self.rejected += 1
