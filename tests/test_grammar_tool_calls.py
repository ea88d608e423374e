"""Tool-call grammars on both backends: llguidance (the structural tag written as Lark) accepts
exactly the strings xgrammar accepts, for GLM-4.7/5 and DeepSeek-V3.2 DSML tool calls, under
`tool_choice` "required", a named tool and "auto" with a strict tool, parallel calls or not.

Each case is a whole answer (then the stop token): right calls, wrong argument values, unknown
keys, missing required arguments, text around calls. A disagreement either way would let one
backend write calls the other forbids."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

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


def glm(name: str, **args: str) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return f"<tool_call>{name}{pairs}</tool_call>"


def dsml(*calls: str) -> str:
    return "\n\n<｜DSML｜function_calls>\n" + "".join(calls) + "</｜DSML｜function_calls>"


def invoke(name: str, **args: tuple[str, str]) -> str:
    params = "".join(f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>\n'
                     for k, (s, v) in args.items())  # fmt: skip
    return f'<｜DSML｜invoke name="{name}">\n{params}</｜DSML｜invoke>\n'


LOOK = {"order_id": "12345", "items": "[1, 2]"}
GLM_CASES = [
    glm("get_weather", city="Paris"), glm("get_weather", city="Paris", days="3"),
    glm("get_weather", city="Paris", days="9"), glm("get_weather", city="Paris", unit='"celsius"'),
    glm("get_weather", city="A very long city"), glm("get_weather", days="2"),
    glm("lookup", **LOOK), glm("lookup", order_id="1234", items="[1]"),
    glm("lookup", order_id="12345", items="[1,  2]"), glm("lookup", order_id="12345"),
    glm("lookup", **LOOK) + glm("get_weather", city="Rome"),
    "Let me check." + glm("get_weather", zzz="q"), "Let me check." + glm("lookup", **LOOK),
    "Let me check." + glm("lookup", order_id="x", items="[]"), "just text", "",
]  # fmt: skip
DSML_LOOK = {"order_id": ("true", "12345"), "items": ("false", "[3]")}
DSML_CASES = [
    dsml(invoke("get_weather", city=("true", "Paris"))),
    dsml(invoke("get_weather", city=("true", "Paris"), days=("false", "8"))),
    dsml(invoke("get_weather", city=("false", '"Paris"'))),
    dsml(invoke("lookup", **DSML_LOOK)), dsml(invoke("lookup", order_id=("true", "12345"))),
    dsml(invoke("lookup", **DSML_LOOK), invoke("get_weather", city=("true", "Oslo"))),
    "Sure." + dsml(invoke("get_weather", other=("true", "x"))).lstrip(),
    "Sure." + dsml(invoke("lookup", **DSML_LOOK)).lstrip(),
    "Sure." + dsml(invoke("lookup", order_id=("true", "1"), items=("false", "[]"))).lstrip(),
    "just text", "",
]  # fmt: skip


@pytest.mark.parametrize(
    "parser,cases",
    [("glm47", GLM_CASES), ("deepseekv32", DSML_CASES)],
)
def test_llguidance_accepts_what_xgrammar_accepts(parser, cases):
    if parser == "glm47":
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        stop = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    else:
        tokenizer = build_deepseek_tokenizer()
        stop = tokenizer.eos_token_id
    backends = [make_backend(name, tokenizer, len(tokenizer), [stop])
                for name in ("xgrammar", "llguidance")]  # fmt: skip
    accepted = 0
    for choice in CHOICES:
        for parallel in (True, False):
            source = tool_call_grammar(parser, [WEATHER, LOOKUP], choice, parallel)
            for text in cases:
                ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], stop]
                verdicts = []
                for backend in backends:
                    matcher = backend.matcher(backend.compile("tool_call_grammar", source))
                    verdicts.append(all(matcher.accept(i) for i in ids))
                assert verdicts[0] == verdicts[1], (parser, choice, parallel, text, verdicts)
                accepted += verdicts[0]
    assert 0.25 < accepted / (len(CHOICES) * 2 * len(cases)) < 0.75  # the cases discriminate
