"""Where thinking ends, the same for the reasoning parser and the grammar: at the trigger token.

With thinking on, a request's grammar is armed until the `</think>` token (`GrammarState`). The
reasoning parser reads text: it also ends thinking at `</think>` spelled by other tokens (`</`,
`think`, `>`), and at its other exits (GLM's `<tool_call>`, DeepSeek's DSML tags). Had the model
written one of those, the parser would read the rest as the answer while the grammar had not
started, and the answer would be unconstrained. So while armed, every token that would complete
one of those texts is masked (`banned`), given the bytes the output ends with; only the trigger
itself may end thinking, where both agree. (The end tokens are masked too: see SamplingState.)
"""

from __future__ import annotations

from typing import Any


class ThinkingExits:
    """The exit tags of one reasoning parser, over one vocabulary (bytes per token id)."""

    def __init__(self, token_bytes: list[bytes], exits: list[str], trigger: int) -> None:
        self.token_bytes = token_bytes
        self.tags = [tag.encode() for tag in exits if tag]
        self.trigger = trigger
        self.keep = max((len(tag) for tag in self.tags), default=1) - 1  # bytes of tail that matter
        # tokens with a whole tag inside them, banned whatever the output ends with
        self._inside = [t for t, data in enumerate(token_bytes)
                        if t != trigger and any(tag in data for tag in self.tags)]  # fmt: skip
        self._banned: dict[frozenset[bytes], list[int]] = {frozenset(): self._inside}

    def tail(self, tail: bytes, token_id: int) -> bytes:
        """The tail after `token_id`: the last bytes that could begin an exit tag."""
        grown = tail + self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else b""
        return grown[-self.keep :] if self.keep else b""

    def banned(self, tail: bytes) -> list[int]:
        """Token ids (not the trigger) whose bytes, after `tail`, would complete an exit tag:
        one inside them, or the rest of a tag whose beginning the tail ends with."""
        rests = frozenset(tag[k:] for tag in self.tags for k in range(1, len(tag))
                          if tail.endswith(tag[:k]))  # fmt: skip
        if rests not in self._banned:
            starts = tuple(rests)
            completing = {t for t, data in enumerate(self.token_bytes)
                          if t != self.trigger and data.startswith(starts)}  # fmt: skip
            self._banned[rests] = sorted(completing.union(self._inside))
        return self._banned[rests]


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """Each token id's bytes as the detokenizer writes them (xgrammar's decoded vocabulary:
    byte-level BPE, SentencePiece and added tokens alike), padded to `vocab_size`."""
    import xgrammar as xgr

    decoded = list(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
                   .decoded_vocab)  # fmt: skip
    return decoded + [b""] * (vocab_size - len(decoded))
