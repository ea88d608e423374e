"""DeepSeek-V3.2 prompts: byte-equal to the checkpoint's own encoder on its published golden
vector and on a table of conversations derived from it and from the encoder's published rules;
plus how the server picks the encoder, resolves the parsers, and constrains
`tool_choice` by the DSML grammar."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from deepseek_checkpoint import build_deepseek_tokenizer
from transformers import AutoTokenizer

from dsaserve.args import ServerArgs
from dsaserve.grammar.backend import make_backend
from dsaserve.server.openai.protocol import ChatCompletionRequest
from dsaserve.server.parsers.events import ToolCallArgs, ToolCallStart
from dsaserve.server.parsers.tool_dsml import DsmlToolParser
from dsaserve.server.templates import deepseek_v32
from dsaserve.server.tokenizer_manager import TokenizerManager, normalize_messages
from dsaserve.web.errors import APIError

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v32"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}}}}  # fmt: skip


def golden() -> tuple[list[dict], str]:
    data = json.loads((FIXTURES / "test_input.json").read_text())
    messages = data["messages"]
    messages[0]["tools"] = data["tools"]  # as the published test attaches them
    return messages, (FIXTURES / "test_output.txt").read_text(encoding="utf-8").strip()


def test_published_golden_vector():
    messages, gold = golden()
    assert deepseek_v32.encode_messages(messages, thinking=True) == gold


def test_table_derived_from_the_golden_vector():
    messages, gold = golden()
    last_user = f"{U}Thanks! What about the day after tomorrow?{A}<think>"
    results_end = "</function_results>\n\n<think>"
    # a conversation cut after the last user turn or after its tool results renders a prefix
    cut_user = gold[: gold.index(last_user) + len(last_user)]
    assert deepseek_v32.encode_messages(messages[:9], thinking=True) == cut_user
    cut_results = gold[: gold.rindex(results_end) + len(results_end)]
    assert deepseek_v32.encode_messages(messages[:12], thinking=True) == cut_results
    # chat mode: every turn closes thinking and no reasoning is shown
    chat = gold
    for message in (messages[9], messages[12]):
        chat = chat.replace(f"<think>{message['reasoning_content']}</think>", "</think>")
    assert deepseek_v32.encode_messages(copy.deepcopy(messages), thinking=False) == chat
    # one turn rendered after its context (the published test's tool-call turn)
    turn = deepseek_v32.encode_messages([messages[4]], thinking=True, context=messages[:4])
    assert turn == (
        "Now I know today is 2024-01-15, so tomorrow is 2024-01-16. Let me query the weather for "
        f"San Francisco and New York.</think>\n\n<{D}function_calls>\n"
        f'<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="location" string="true">San Francisco</{D}parameter>\n'
        f'<{D}parameter name="date" string="true">2024-01-16</{D}parameter>\n</{D}invoke>\n'
        f'<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="location" string="true">New York</{D}parameter>\n'
        f'<{D}parameter name="date" string="true">2024-01-16</{D}parameter>\n</{D}invoke>\n'
        f"</{D}function_calls>{EOS}"
    )


HISTORY = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
    {"role": "user", "content": "1+1=?"},
]
ARGS = {"n": 3, "s": "x", "o": {"k": [1, "é"]}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": ARGS}}
TABLE = [
    # the encoder's published usage example, thinking and chat
    (HISTORY, True, f"{BOS}{U}hello{A}</think>Hello! I am DeepSeek.{EOS}{U}1+1=?{A}<think>"),
    (HISTORY, False, f"{BOS}{U}hello{A}</think>Hello! I am DeepSeek.{EOS}{U}1+1=?{A}</think>"),
    # system text is bare; non-string arguments are JSON, strings raw; one result closes thinking
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
      {"role": "assistant", "content": "c", "tool_calls": [CALL]},
      {"role": "tool", "content": "r"}], True,
     f"{BOS}S{U}u{A}<think></think>c\n\n<{D}function_calls>\n<{D}invoke name=\"f\">\n"
     f'<{D}parameter name="n" string="false">3</{D}parameter>\n'
     f'<{D}parameter name="s" string="true">x</{D}parameter>\n'
     f'<{D}parameter name="o" string="false">{{"k": [1, "é"]}}</{D}parameter>\n'
     f"</{D}invoke>\n</{D}function_calls>{EOS}\n\n<function_results>\n<result>r</result>\n"
     "</function_results>\n\n<think>"),
    # a call with no arguments; chat mode
    ([{"role": "user", "content": "u"},
      {"role": "assistant", "tool_calls": [{"function": {"name": "g", "arguments": "{}"}}]},
      {"role": "tool", "content": "r"}], False,
     f"{BOS}{U}u{A}</think>\n\n<{D}function_calls>\n<{D}invoke name=\"g\">\n\n</{D}invoke>\n"
     f"</{D}function_calls>{EOS}\n\n<function_results>\n<result>r</result>\n"
     "</function_results>\n\n</think>"),
    # a developer turn: its text follows the tools, after "# The user's message is:"
    ([{"role": "developer", "content": "d"}], True,
     f"{BOS}{U}\n\n# The user's message is: d{A}<think>"),
]  # fmt: skip


@pytest.mark.parametrize(("messages", "thinking", "expected"), TABLE)
def test_table(messages: list[dict], thinking: bool, expected: str):
    assert deepseek_v32.encode_messages(messages, thinking) == expected


def test_request_glue_as_sglang_sends_it():
    # no system turn: an empty one carries the tools
    prompt = deepseek_v32.render_chat([{"role": "user", "content": "u"}], [TOOL], True)
    assert prompt.startswith(f"{BOS}\n\n## Tools\n\nYou have access")
    assert prompt.endswith(f'"string"}}}}}}}}\n</functions>\n{U}u{A}<think>')
    # a trailing assistant turn is sent as a user turn
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert deepseek_v32.render_chat(turns, None, False) == f"{BOS}{U}a{A}</think>{U}b{A}</think>"


def test_encoder_errors():
    with pytest.raises(deepseek_v32.EncodingError):
        deepseek_v32.encode_messages([{"role": "tool", "content": "r"}], False)
    after_user = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                  {"role": "tool", "content": "r"}]  # fmt: skip
    with pytest.raises(deepseek_v32.EncodingError):
        deepseek_v32.encode_messages(after_user, True)


# ---- the server side: which prompt format, which parsers, tool_choice forcing
@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSeek-V3.2 tokenizer and config only (nothing here runs the model)."""
    path = tmp_path_factory.mktemp("ds_tok")
    build_deepseek_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    return path


def manager(folder: Path, **flags) -> TokenizerManager:
    args = ServerArgs(model_path=str(folder), **flags)
    return TokenizerManager(args, AutoTokenizer.from_pretrained(folder), {"context_length": 64})


def render(tm: TokenizerManager, messages: list[dict], tools=None, **kwargs) -> str:
    req = ChatCompletionRequest(messages=messages)
    return tm.render_chat(normalize_messages(req.messages), tools, tm.template_kwargs(kwargs, None))


def test_encoder_and_parsers_are_chosen_from_the_checkpoint(folder: Path, tmp_path: Path):
    tm = manager(folder)
    assert (tm.builtin_encoder, tm.reasoning_parser, tm.tool_parser) == (
        True, "deepseek-v3", "deepseekv32")  # fmt: skip
    user = [{"role": "user", "content": "hi"}]
    assert render(tm, user) == f"{BOS}{U}hi{A}</think>"  # thinking is off unless asked for
    assert render(tm, user, thinking=True) == f"{BOS}{U}hi{A}<think>"
    assert tm.template_kwargs(None, "high")["thinking"] is True  # reasoning_effort turns it on
    with pytest.raises(APIError) as e:  # a broken history is the client's error
        render(tm, [{"role": "tool", "content": "r", "tool_call_id": "x"}])
    assert e.value.status == 400
    # another DeepSeek checkpoint gets the encoder when asked for the DSML parser, as in sglang
    shutil.copytree(folder, tmp_path / "v3")
    (tmp_path / "v3" / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert not manager(tmp_path / "v3").builtin_encoder
    tm = manager(tmp_path / "v3", tool_call_parser="deepseekv32")
    assert tm.builtin_encoder and render(tm, user) == f"{BOS}{U}hi{A}</think>"
    # a checkpoint that ships a chat template uses it, and auto finds no DeepSeek parser in it
    shutil.copytree(folder, tmp_path / "jinja")
    (tmp_path / "jinja" / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    tm = manager(tmp_path / "jinja")
    assert (tm.builtin_encoder, tm.reasoning_parser, tm.tool_parser) == (False, None, None)
    assert render(tm, user) == "Jhi"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["location"], "properties": {
        "location": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
        "units": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"}}}}}  # fmt: skip
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}


def grammar_fields(tm: TokenizerManager, choice, prompt: str, tools: list[dict]) -> dict:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                tool_choice=choice)  # fmt: skip
    return tm.structured.chat_fields(
        req, tools, choice, tm.tool_parser, prompt, tm.reasoning_parser
    )


def accepts(tm: TokenizerManager, fields: dict, text: str) -> bool:
    """Whether the request's grammar, on the real tokenizer, takes `text` and then the stop."""
    eos = tm.tokenizer.convert_tokens_to_ids(EOS)
    backend = make_backend("xgrammar", tm.tokenizer, len(tm.tokenizer), [eos])
    matcher = backend.matcher(backend.compile("tool_call_grammar", fields["tool_call_grammar"]))
    ids = tm.tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept(t) for t in ids) and matcher.accept(eos) and matcher.is_terminated()


def section(*calls: tuple[str, dict]) -> str:
    """The DSML section as the checkpoint's encoder renders these calls in history."""
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for n, a in calls]}  # fmt: skip
    text = deepseek_v32.encode_messages([message], thinking=False, context=[{"role": "user"}])
    return text.removesuffix(EOS)


def parsed(text: str, tools: list[dict]) -> list[tuple[str, dict]]:
    parser = DsmlToolParser(tools)
    events = parser.feed(text) + parser.finish()
    starts = [e.name for e in events if isinstance(e, ToolCallStart)]
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallArgs):
            args[e.index] = args.get(e.index, "") + e.fragment
    return [(name, json.loads(args.get(i, "{}"))) for i, name in enumerate(starts)]


def test_tool_choice_required_and_named_are_a_dsml_grammar(folder: Path):
    """tool_choice required / named is the DSML grammar: it takes exactly the calls the encoder
    renders and the parser reads back valid, refuses other tools and values off the schema."""
    tm = manager(folder)
    tools = [WEATHER, NOW]
    thinking = render(tm, [{"role": "user", "content": "hi"}], tools, thinking=True)
    chat = render(tm, [{"role": "user", "content": "hi"}], tools)
    assert grammar_fields(tm, "auto", thinking, tools) == {}  # no strict tool: free
    assert grammar_fields(tm, "none", thinking, tools) == {}
    required = grammar_fields(tm, "required", thinking, tools)
    assert required["grammar_after_token_id"] == tm.tokenizer.convert_tokens_to_ids("</think>")
    named = grammar_fields(tm, {"type": "function", "function": {"name": "get_weather"}},
                           chat, tools)  # fmt: skip
    assert named["grammar_after_token_id"] is None  # thinking off: the call opens at once
    good = ("get_weather", {"location": "Oslo", "days": 3, "units": "c", "hourly": False})
    for fields in (required, named):
        for call in (good, ("get_weather", {"location": "São Paulo, SP"})):
            text = section(call)
            assert accepts(tm, fields, text), text
            assert parsed(text, tools) == [call]
            jsonschema.validate(call[1], WEATHER["function"]["parameters"])
        off_schema = [("get_weather", {"days": 3}), ("get_weather", {"location": "x", "days": 0}),
                      ("get_weather", {"location": "x", "units": "k"}),
                      ("get_weather", {"location": "x", "days": "3"})]  # fmt: skip
        for call in off_schema:
            assert not accepts(tm, fields, section(call)), call
        assert not accepts(tm, fields, "Sure." + section(good))  # only the call
    assert accepts(tm, required, section(good, ("now", {})))  # back to back, any declared tool
    assert not accepts(tm, named, section(("now", {})))
    assert not accepts(tm, named, section(good, good))  # exactly one call


def test_strict_dsml_tools_leave_text_free_and_constrain_the_call(folder: Path):
    tm = manager(folder)
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    fields = grammar_fields(tm, "auto", render(tm, [{"role": "user", "content": "hi"}]),
                            [strict, NOW])  # fmt: skip
    assert accepts(tm, fields, "Just text.")
    assert accepts(tm, fields, "Let me check." + section(("get_weather", {"location": "Rome"})))
    assert not accepts(tm, fields, "x" + section(("get_weather", {"location": 5})))
    assert accepts(tm, fields, "x" + section(("now", {"any": "thing"})))  # not strict: free
