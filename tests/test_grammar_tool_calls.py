"""Tool-call grammars on both backends (xgrammar's structural tag, llguidance's Lark) accept
exactly the answers the request's rules allow, for GLM-4.7/5 and DeepSeek-V3.2 DSML tool calls,
under `tool_choice` "required", a named tool and "auto" with a strict tool, parallel calls or
not.

Each case is a whole answer (then the stop token): right calls, wrong argument values, unknown
keys, missing required arguments, text before calls, each labelled by hand with whether its
arguments satisfy the tool's schema as the grammar writes it; `expected` turns the labels and
the choice into a verdict without looking at the grammar, so a bug in the grammar's source
(shared by both backends) fails here, not only a disagreement between them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from dsaserve.assets import default_model_path
from dsaserve.grammar.backend import make_backend
from dsaserve.grammar.tool_calls import tool_call_grammar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deepseek_checkpoint import build_deepseek_tokenizer  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]}}}}}  # fmt: skip
LOOKUP = {"type": "function", "function": {"name": "lookup", "strict": True, "parameters": {
    "type": "object", "required": ["order_id", "items"], "properties": {
        "order_id": {"type": "string", "pattern": "^[0-9]{5}$"},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "maxItems": 3}}}}}  # fmt: skip
CHOICES = ["required", {"type": "function", "function": {"name": "lookup"}}, "auto"]


class Case(NamedTuple):
    """An answer, with what a reader of the schemas says of it: each call's tool and whether its
    arguments are exactly what that tool's grammar writes when it is enforced (`ok`)."""

    text: str
    calls: tuple[tuple[str, bool], ...] = ()
    prose: bool = False  # free text before the calls


def glm(name: str, ok: bool, **args: str) -> Case:
    pairs = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return Case(f"<tool_call>{name}{pairs}</tool_call>", ((name, ok),))


def then(*cases: Case, prose: str = "") -> Case:
    text = prose + "".join(c.text for c in cases)
    return Case(text, tuple(call for c in cases for call in c.calls), bool(prose))


def dsml(*calls: Case, prose: str = "") -> Case:
    body = "".join(c.text for c in calls)
    text = (prose or "\n\n") + "<｜DSML｜function_calls>\n" + body + "</｜DSML｜function_calls>"
    return Case(text, tuple(call for c in calls for call in c.calls), bool(prose))


def invoke(name: str, ok: bool, **args: tuple[str, str]) -> Case:
    params = "".join(f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>\n'
                     for k, (s, v) in args.items())  # fmt: skip
    return Case(f'<｜DSML｜invoke name="{name}">\n{params}</｜DSML｜invoke>\n', ((name, ok),))


def expected(case: Case, choice, parallel: bool) -> bool:
    """The verdict the request's rules give, independently of how the grammar is built:
    "required": calls only, at least one; a named tool: exactly that call; "auto": free text,
    then calls; one call at most without `parallel`. Arguments must be `ok` where the tool is
    enforced: every tool when the choice forces a call, under "auto" the strict one (lookup)
    only, the others take any key/value pairs."""
    if not parallel and len(case.calls) > 1:
        return False
    if choice == "auto":
        return all(ok or name != "lookup" for name, ok in case.calls)
    if case.prose or not case.calls or not all(ok for _, ok in case.calls):
        return False
    return choice == "required" or (len(case.calls) == 1 and case.calls[0][0] == "lookup")


LOOK = {"order_id": "12345", "items": "[1, 2]"}
GLM_CASES = [
    glm("get_weather", True, city="Paris"), glm("get_weather", True, city="Paris", days="3"),
    glm("get_weather", False, city="Paris", days="9"),  # days > maximum
    glm("get_weather", False, city="Paris", unit='"celsius"'),  # a raw string, not JSON
    glm("get_weather", False, city="A very long city"),  # over maxLength
    glm("get_weather", False, days="2"),  # city is required
    glm("lookup", True, **LOOK), glm("lookup", False, order_id="1234", items="[1]"),
    glm("lookup", False, order_id="12345", items="[1,  2]"),  # two spaces: not compact
    glm("lookup", False, order_id="12345"),  # items is required
    then(glm("lookup", True, **LOOK), glm("get_weather", True, city="Rome")),
    then(glm("get_weather", False, zzz="q"), prose="Let me check."),  # an unknown key
    then(glm("lookup", True, **LOOK), prose="Let me check."),
    then(glm("lookup", False, order_id="x", items="[]"), prose="Let me check."),
    Case("just text", prose=True), Case(""),
]  # fmt: skip
DSML_LOOK = {"order_id": ("true", "12345"), "items": ("false", "[3]")}
DSML_CASES = [
    dsml(invoke("get_weather", True, city=("true", "Paris"))),
    dsml(invoke("get_weather", False, city=("true", "Paris"), days=("false", "8"))),
    dsml(invoke("get_weather", False, city=("false", '"Paris"'))),  # a string is string="true"
    dsml(invoke("lookup", True, **DSML_LOOK)),
    dsml(invoke("lookup", False, order_id=("true", "12345"))),  # items is required
    dsml(invoke("lookup", True, **DSML_LOOK), invoke("get_weather", True, city=("true", "Oslo"))),
    dsml(invoke("get_weather", False, other=("true", "x")), prose="Sure."),
    dsml(invoke("lookup", True, **DSML_LOOK), prose="Sure."),
    dsml(invoke("lookup", False, order_id=("true", "1"), items=("false", "[]")), prose="Sure."),
    Case("just text", prose=True), Case(""),
]  # fmt: skip


def tokenizer_and_stop(parser: str):
    """The tokenizer a parser's model speaks (the embedded GLM's or a DeepSeek-V3.2 one) and its
    end-of-text token id."""
    if parser == "glm47":
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        return tokenizer, tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer = build_deepseek_tokenizer()
    return tokenizer, tokenizer.eos_token_id


@pytest.mark.parametrize(
    "parser,cases",
    [("glm47", GLM_CASES), ("deepseekv32", DSML_CASES)],
)
def test_llguidance_accepts_what_xgrammar_accepts(parser, cases):
    tokenizer, stop = tokenizer_and_stop(parser)
    backends = [make_backend(name, tokenizer, len(tokenizer), [stop])
                for name in ("xgrammar", "llguidance")]  # fmt: skip
    wrong = []
    for choice in CHOICES:
        for parallel in (True, False):
            source = tool_call_grammar(parser, [WEATHER, LOOKUP], choice, parallel)
            matchers = [(b, b.compile("tool_call_grammar", source)) for b in backends]
            for case in cases:
                ids = [*tokenizer(case.text, add_special_tokens=False)["input_ids"], stop]
                want = expected(case, choice, parallel)
                for name, (backend, compiled) in zip(("xgrammar", "llguidance"), matchers):
                    matcher = backend.matcher(compiled)
                    if all(matcher.accept(i) for i in ids) != want:
                        wrong.append((name, choice, parallel, case.text, want))
    assert not wrong, "\n".join(map(repr, wrong))


NOTES = {"type": "function", "function": {"name": "note", "strict": True, "parameters": {
    "type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}}}}}}  # fmt: skip
OPENINGS = {  # the answer up to inside the first string of the `tags` array
    "glm47": '<tool_call>note<arg_key>tags</arg_key><arg_value>["a',
    "deepseekv32": '\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="note">\n'
                   '<｜DSML｜parameter name="tags" string="false">["a',
}  # fmt: skip


@pytest.mark.parametrize("parser", ["glm47", "deepseekv32"])
def test_json_argument_strings_hold_json_characters(parser):
    """A string inside a JSON argument value holds JSON's characters only: not a raw control
    character (`json.loads` refuses it) nor the UTF-8 bytes of a surrogate (ED A0 80 decodes to
    three U+FFFD, which outgrows `maxLength`); xgrammar's own JSON strings let both through."""
    tokenizer, stop = tokenizer_and_stop(parser)
    # each byte's own token, through the byte-level alphabet (GPT-2's byte -> character map)
    byte = {b: tokenizer.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    opening = tokenizer(OPENINGS[parser], add_special_tokens=False)["input_ids"]
    source = tool_call_grammar(parser, [NOTES], "required", False)
    nexts = [("a letter", b"b", True), ("a raw control character", b"\x07", False),
             ("a surrogate's bytes", b"\xed\xa0\x80", False)]  # fmt: skip
    wrong = []
    for name in ("xgrammar", "llguidance"):
        backend = make_backend(name, tokenizer, len(tokenizer), [stop])
        compiled = backend.compile("tool_call_grammar", source)
        for what, spelled, allowed in nexts:
            matcher = backend.matcher(compiled)
            assert all(matcher.accept(i) for i in opening), (name, OPENINGS[parser])
            if all(matcher.accept(byte[b]) for b in spelled) != allowed:
                wrong.append((name, what))
    assert not wrong, wrong
