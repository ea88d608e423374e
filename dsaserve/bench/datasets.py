"""Benchmark workloads: random prompts and shared-prefix prompts of controlled token length.

With a tokenizer, prompts are random token ids decoded to text (re-encoded once so the recorded
length is what the tokenizer really sees). Without one, prompts are random words and lengths are
estimated as characters / 4.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 4  # the rough estimate used when no tokenizer is available
_MAX_FIT_ROUNDS = 8

_WORDS = (
    "the of and to in is was that for on as with by at from his an were are which this be "
    "or has had not but one have they you all their there been if more when will would who "
    "so no time about out up into than them can only other new some could these two may "
    "then do first any like now my over such our man me even most made after also did many "
    "before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One workload item: the prompt text, its length in tokens, and the output tokens to ask."""

    prompt: str
    prompt_len: int
    output_len: int


class TokenCounter:
    """Counts tokens with a real tokenizer when one is loaded, else estimates chars / 4."""

    def __init__(self, tokenizer: Any | None = None, source: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.source = source  # where the tokenizer came from, for the report

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return math.ceil(len(text) / CHARS_PER_TOKEN)
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer(path: str) -> Any:
    """Load a tokenizer from a local folder; raise ValueError with the reason if it cannot."""
    if not Path(path).is_dir():
        raise ValueError(f"--tokenizer: {path!r} is not a local folder")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many kinds; report them all the same way
        raise ValueError(f"--tokenizer: cannot load a tokenizer from {path!r}: {exc}") from exc


def sample_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length uniform in [length * range_ratio, length] (at least 1), as sglang.bench_serving."""
    low = max(int(length * range_ratio), 1)
    return rng.randint(low, max(length, low))


def random_text(rng: random.Random, num_tokens: int, counter: TokenCounter) -> tuple[str, int]:
    """Random text of about `num_tokens` tokens, and its measured length."""
    if counter.tokenizer is None:
        return _random_words(rng, num_tokens)
    return _random_token_text(rng, num_tokens, counter.tokenizer)


def _random_words(rng: random.Random, num_tokens: int) -> tuple[str, int]:
    target_chars = num_tokens * CHARS_PER_TOKEN
    words: list[str] = []
    length = -1
    while length + 1 < target_chars:
        words.append(rng.choice(_WORDS))
        length += len(words[-1]) + 1
    text = " ".join(words)[:target_chars]
    return text, math.ceil(len(text) / CHARS_PER_TOKEN)


def _random_token_text(rng: random.Random, num_tokens: int, tokenizer: Any) -> tuple[str, int]:
    special = set(tokenizer.all_special_ids)
    vocab_size = len(tokenizer)
    ids: list[int] = []
    while len(ids) < num_tokens:
        token_id = rng.randrange(vocab_size)
        if token_id not in special:
            ids.append(token_id)
    # Decoding then encoding can merge or split tokens (a cut multi-byte character becomes a
    # 3-byte U+FFFD): re-encode and cut until the text reads as at most `num_tokens` tokens.
    text = tokenizer.decode(ids, skip_special_tokens=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    keep = num_tokens
    for _ in range(_MAX_FIT_ROUNDS):
        text = tokenizer.decode(ids[:keep], skip_special_tokens=True)
        measured = len(tokenizer.encode(text, add_special_tokens=False))
        if measured <= num_tokens:
            break
        keep -= measured - num_tokens
    return text, measured


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    counter: TokenCounter,
    seed: int,
) -> list[BenchRequest]:
    """`num_prompts` independent random prompts (sglang.bench_serving `--dataset-name random`)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        prompt, prompt_len = random_text(rng, sample_len(rng, input_len, range_ratio), counter)
        requests.append(BenchRequest(prompt, prompt_len, sample_len(rng, output_len, range_ratio)))
    return requests


def shared_prefix_requests(
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    range_ratio: float,
    counter: TokenCounter,
    seed: int,
) -> list[BenchRequest]:
    """Many requests over a few long shared prefixes (system prompts), in shuffled order.

    Request i uses prefix i % num_prefixes followed by its own random suffix, so a server with a
    prefix cache computes each prefix once.
    """
    rng = random.Random(seed)
    prefixes = [random_text(rng, prefix_len, counter)[0] for _ in range(num_prefixes)]
    requests = []
    for index in range(num_prompts):
        suffix, _ = random_text(rng, sample_len(rng, suffix_len, range_ratio), counter)
        prompt = f"{prefixes[index % num_prefixes]}\n\n{suffix}"
        out_len = sample_len(rng, output_len, range_ratio)
        requests.append(BenchRequest(prompt, counter.count(prompt), out_len))
    rng.shuffle(requests)
    return requests
