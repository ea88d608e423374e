"""Incremental detokenization with stop strings, for streaming one request's output.

Decoding uses the "prefix offset / read offset" scheme of vLLM and TGI: each new token is decoded
together with the few tokens before it (the prefix window), and only the text past the window's
own decode is new. A decode that ends in U+FFFD is an incomplete UTF-8 character: it is held back
until a later token completes it (or `flush` releases it). Each token costs O(window) work.

Stop strings: text that could still be the start of a stop string is held back. The first match
is the one that ends earliest (what a character-by-character stream would see first; on a tie,
the longest), so the result does not depend on how the tokens were split into pushes.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token (leading spaces)


class IncrementalDetokenizer:
    """Turns one request's output tokens into confirmed text, watching for stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int] | None,
        stop: list[str],
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.stop = [s for s in stop if s]
        self.text = ""
        self.matched: str | None = None
        self._pending = ""  # decoded, not yet confirmed: could start a stop string
        self._init_window(prompt_ids or [])

    def _init_window(self, prompt_ids: list[int]) -> None:
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        if context and self._decode(context).endswith("\ufffd"):
            context = []  # the prompt ends inside a character: decode the output on its own
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def push(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Feed new tokens; return (newly confirmed text, matched stop string or None).

        Confirmed text excludes a trailing incomplete UTF-8 character and anything that could
        still be the beginning of a stop string. When a stop string matches, the text ends right
        before it (or includes it with no_stop_trim) and the request must finish; later pushes
        return ("", None).
        """
        if self.matched is not None:
            return "", None
        for token_id in token_ids:
            self._pending += self._decode_next(token_id)
        return self._confirm(final=False)

    def flush(self) -> str:
        """At finish (length/eos/abort): the held-back text, trimmed if it completes a stop."""
        if self.matched is not None:
            return ""
        self._pending += self._decode_tail()
        self._ids = self._ids[self._read_offset :]
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._confirm(final=True)[0]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_next(self, token_id: int) -> str:
        """The text token_id completes, or "" while it ends inside a character."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._trim_window()
        return full_text[len(prefix_text) :]

    def _trim_window(self) -> None:
        """Advance the window to the new read point, dropping ids no later decode needs."""
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode_tail(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        return full_text[len(prefix_text) :]

    def _confirm(self, final: bool) -> tuple[str, str | None]:
        match = self._first_match(self._pending)
        if match is not None:
            start, stop = match
            out = self._pending[: start + len(stop) if self.no_stop_trim else start]
            self.matched, self._pending = stop, ""
        else:
            keep = 0 if final else self._stop_prefix_len(self._pending)
            out = self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(out) :]
        self.text += out
        return out, match[1] if match else None

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop) of the stop match that ends first (ties: the longest), or None."""
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                best = key if best is None or key[:2] < best[:2] else best
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
