from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dsaserve.engine.detokenizer import IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|user|>", "<think>"]
CORPUS = [
    "Hello world, this is a small corpus for a byte-level BPE tokenizer.",
    "The quick brown fox jumps over the lazy dog. Stop here! STOP. END of text.",
    "中文文本的分词测试，我们需要一些汉字。日本語のテキストも少し。",
    "Emoji time 😀🎉👍🏽 and flags 🇫🇷, accents: café, naïve, Ünïcödé.",
    "def f(x):\n    return x * 2  # code\n\tindented",
    "Ελληνικά και русский текст, עברית, العربية",
]
ALPHABET = "ab cd\n!.<>" + "中文字汉" + "éü" + "😀🎉👍🏽" + "Ωж"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=SPECIALS)


def decode(tokenizer, ids: list[int], skip: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Reference: the match that ends first (ties: the longest)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    return (min(found)[1], min(found)[2]) if found else None


def stream(det: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> tuple[list, str]:
    """Push ids in chunks of `sizes` (cycled) until a stop matches; return pieces and the stop."""
    pieces, reported, pos, i = [], [], 0, 0
    while pos < len(ids) and not reported:
        size = sizes[i % len(sizes)] if sizes else len(ids)
        text, stop = det.push(ids[pos : pos + size])
        pieces.append(text)
        reported += [stop] if stop else []
        pos, i = pos + size, i + 1
    pieces.append(det.flush())
    # A stop can only complete at flush when it ends in an incomplete character (U+FFFD).
    assert reported in ([], [det.matched])
    return pieces, det.matched


def expected(full: str, stops: list[str], no_stop_trim: bool) -> tuple[str, str | None]:
    match = first_stop(full, stops)
    if match is None:
        return full, None
    start, stop = match
    return full[: start + len(stop)] if no_stop_trim else full[:start], stop


@st.composite
def token_streams(draw, tokenizer):
    if draw(st.booleans()):
        text = draw(st.text(alphabet=ALPHABET, max_size=40))
        if draw(st.booleans()):
            text += draw(st.sampled_from(SPECIALS)) + draw(st.text(alphabet=ALPHABET, max_size=8))
        return tokenizer.encode(text, add_special_tokens=False)
    return draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_pieces_concatenate_to_the_full_decode_for_any_split(tokenizer, data):
    ids = data.draw(token_streams(tokenizer))
    skip = data.draw(st.booleans())
    no_stop_trim = data.draw(st.booleans())
    full = decode(tokenizer, ids, skip)
    stops = data.draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), max_size=2))
    if full and data.draw(st.booleans()):
        start = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[start : start + data.draw(st.integers(1, 4))])
    prompt = data.draw(st.none() | st.lists(st.integers(0, len(tokenizer) - 1), max_size=8))
    sizes = data.draw(st.lists(st.integers(1, 5), max_size=6))

    det = IncrementalDetokenizer(tokenizer, prompt, stops, skip, no_stop_trim)
    pieces, matched = stream(det, ids, sizes)

    want_text, want_stop = expected(full, stops, no_stop_trim)
    assert "".join(pieces) == want_text
    assert matched == want_stop
    assert det.text == want_text


def push_one_by_one(det: IncrementalDetokenizer, ids: list[int]) -> list[tuple[str, str | None]]:
    return [det.push([token_id]) for token_id in ids]


def test_multibyte_character_split_across_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("a🇫🇷", add_special_tokens=False)
    flag_ids = ids[1:]
    assert len(flag_ids) > 1  # the flag spans several byte tokens
    det = IncrementalDetokenizer(tokenizer, None, [])
    outputs = [text for text, _ in push_one_by_one(det, ids)]
    assert outputs[0] == "a"
    assert "\ufffd" not in "".join(outputs)
    assert "".join(outputs) + det.flush() == "a🇫🇷"


def test_incomplete_character_at_finish_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("x😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    det = IncrementalDetokenizer(tokenizer, None, [])
    assert "".join(t for t, _ in push_one_by_one(det, ids)) == "x"
    assert det.flush() == decode(tokenizer, ids)[1:]
    assert det.flush() == ""  # nothing is released twice


def test_stop_string_split_across_tokens(tokenizer):
    text = "Hello world STOP. END of text"
    ids = tokenizer.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, None, ["STOP.", "END"])
    results = push_one_by_one(det, ids)
    matches = [stop for _, stop in results if stop]
    assert matches == ["STOP."]
    assert "".join(t for t, _ in results) == "Hello world "
    assert det.text == "Hello world "
    assert det.push(ids[:2]) == ("", None)  # finished: nothing more
    assert det.flush() == ""


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    det = IncrementalDetokenizer(tokenizer, None, ["<END>"])
    first = tokenizer.encode("ab<EN", add_special_tokens=False)
    assert "".join(t for t, _ in push_one_by_one(det, first)) == "ab"
    text, stop = det.push(tokenizer.encode("X", add_special_tokens=False))
    assert (text, stop) == ("<ENX", None)
    det2 = IncrementalDetokenizer(tokenizer, None, ["<END>"])
    push_one_by_one(det2, first)
    assert det2.flush() == "<EN"


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode("Stop here! STOP. more", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, None, ["STOP"], no_stop_trim=True)
    results = push_one_by_one(det, ids)
    assert "".join(t for t, _ in results) == "Stop here! STOP"
    assert [s for _, s in results if s] == ["STOP"]


def test_earliest_ending_stop_wins(tokenizer):
    ids = tokenizer.encode("xabcd", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, None, ["abcd", "bc"])
    pieces, matched = stream(det, ids, [len(ids)])  # all at once: same answer as one by one
    assert ("".join(pieces), matched) == ("xa", "bc")


def test_special_tokens_skipped_or_shown(tokenizer):
    ids = tokenizer.encode("hi<|user|>there", add_special_tokens=False)
    for skip, want in ((True, "hithere"), (False, "hi<|user|>there")):
        det = IncrementalDetokenizer(tokenizer, None, [], skip_special_tokens=skip)
        assert "".join(t for t, _ in push_one_by_one(det, ids)) + det.flush() == want


def test_stop_string_made_of_a_special_token(tokenizer):
    ids = tokenizer.encode("answer<think>hidden", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, None, ["<think>"], skip_special_tokens=False)
    pieces, matched = stream(det, ids, [1])
    assert ("".join(pieces), matched) == ("answer", "<think>")


def test_prompt_context_keeps_the_output_text(tokenizer):
    prompt = tokenizer.encode("The quick brown", add_special_tokens=False)
    ids = tokenizer.encode(" fox jumps", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, prompt, [])
    assert "".join(t for t, _ in push_one_by_one(det, ids)) + det.flush() == " fox jumps"


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call received."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids, **kw) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, **kw)


def test_each_token_redecodes_a_bounded_window(tokenizer):
    counting = CountingTokenizer(tokenizer)
    text = " ".join(["Hello world 中文 😀"] * 60)
    ids = tokenizer.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(counting, tokenizer.encode("prompt", add_special_tokens=False), [])
    assert "".join(t for t, _ in push_one_by_one(det, ids)) + det.flush() == text
    assert len(ids) > 300
    assert max(counting.sizes) <= 8
    assert len(counting.sizes) <= 2 * len(ids) + 3
