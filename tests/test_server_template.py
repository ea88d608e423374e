"""Chat template rendering and request preparation in the API process (serving-api.md §3),
plus start-up flag checks of `dsaserve serve`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dsaserve.args import ServerArgs
from dsaserve.assets import default_model_path
from dsaserve.server import launch
from dsaserve.server.openai.protocol import ChatCompletionRequest
from dsaserve.server.tokenizer_manager import TokenizerManager, normalize_messages
from dsaserve.web.errors import APIError

FIXTURES = Path(__file__).parent / "fixtures"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer + GLM-5-style template only (no weights: nothing here runs the model)."""
    path = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / name, path / name)
    shutil.copy(FIXTURES / "glm5_chat_template.jinja", path / "chat_template.jinja")
    return path


def manager(folder: Path, **flags) -> TokenizerManager:
    args = ServerArgs(model_path=str(folder), **flags)
    return TokenizerManager(args, AutoTokenizer.from_pretrained(folder), {"context_length": 64})


def render(tm: TokenizerManager, messages: list[dict], tools=None, **kwargs) -> str:
    req = ChatCompletionRequest(messages=messages)
    return tm.render_chat(normalize_messages(req.messages), tools, tm.template_kwargs(kwargs, None))


def test_worked_examples(folder: Path):
    tm = manager(folder)
    prompt = render(tm, [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                    tools=[TOOL])  # fmt: skip
    assert prompt.startswith("[gMASK]<sop><|system|>\n# Tools")
    assert prompt.endswith("</tool_call><|system|>S<|user|>U<|assistant|><think>")
    history = [
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "TEXT", "reasoning_content": "R", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "OUT"},
    ]  # fmt: skip
    assert render(tm, history).endswith(
        "<|assistant|><think>R</think>TEXT<tool_call>f<arg_key>a</arg_key><arg_value>1"
        "</arg_value></tool_call><|observation|><tool_response>OUT</tool_response>"
        "<|assistant|><think>"
    )


def test_template_kwargs_merge_and_reasoning_effort(folder: Path):
    tm = manager(folder, default_chat_template_kwargs='{"enable_thinking": false, "x": 1}')
    assert tm.template_kwargs(None, None) == {"enable_thinking": False, "x": 1}
    assert tm.template_kwargs({"enable_thinking": True}, None)["enable_thinking"] is True
    plain = manager(folder)
    assert plain.template_kwargs(None, "none")["enable_thinking"] is False
    assert plain.template_kwargs({"enable_thinking": True}, "none")["enable_thinking"] is True
    user = [{"role": "user", "content": "U"}]
    assert render(tm, user).endswith("<|assistant|></think>")
    assert render(plain, user).endswith("<|assistant|><think>")


def test_limits(folder: Path):
    tm = manager(folder)
    assert tm.fit_max_tokens(10, None, "max_tokens") == 54
    assert tm.fit_max_tokens(10, 5, "max_tokens") == 5
    with pytest.raises(APIError) as e:
        tm.fit_max_tokens(64, 1, "max_tokens")
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as e:
        tm.fit_max_tokens(1, 65, "max_tokens")
    assert e.value.param == "max_tokens"
    requests = tm.make_requests([1, 2], tm.sampling({"n": 3, "seed": 5}, 4), "r")
    assert [r.rid for r in requests] == ["r-0", "r-1", "r-2"]
    assert [r.sampling["seed"] for r in requests] == [5, 6, 7]


def test_start_up_flag_errors(folder: Path, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit):
        launch.main(["--model-path", str(folder), "--no-such-flag"])
    assert launch.main(["--model-path", str(folder / "missing")]) == 2
    assert launch.main(["--model-path", str(folder), "--tp", "0"]) == 2
    assert "--tp-size must be >= 1" in capsys.readouterr().err


def test_tool_choice_required_and_named_become_a_tool_call_grammar(folder: Path):
    tm = manager(folder, tool_call_parser="glm47")
    vocab = tm.tokenizer.get_vocab()
    thinking = render(tm, [{"role": "user", "content": "hi"}], [TOOL])
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    fields = lambda choice, prompt: tm.structured.chat_fields(
        request, [TOOL], choice, "glm47", prompt, tm.reasoning_parser
    )  # noqa: E731
    assert fields("auto", thinking) == {}  # not strict: no grammar
    assert fields("none", thinking) == {}
    required = fields("required", thinking)
    assert required["grammar_after_token_id"] == vocab["</think>"]  # the answer after thinking
    assert required["grammar_think_exits"] == ["</think>", "<tool_call>"]  # the parser's exits
    unsplit = tm.structured.chat_fields(request, [TOOL], "required", "glm47", thinking, None)
    assert unsplit["grammar_after_token_id"] is None  # no reasoning parser: all is the answer
    assert json.loads(required["tool_call_grammar"])["mode"] == "required"
    named = fields({"type": "function", "function": {"name": "f"}},
                   thinking.removesuffix("<think>") + "</think>")  # fmt: skip
    assert named["grammar_after_token_id"] is None  # thinking off: constrained from the start
    assert json.loads(named["tool_call_grammar"])["tools"][0]["name"] == "f"
    strict = dict(TOOL, function=dict(TOOL["function"], strict=True))
    auto = tm.structured.chat_fields(request, [strict], "auto", "glm47", thinking, "glm45")
    assert json.loads(auto["tool_call_grammar"])["mode"] == "auto"
    none = manager(folder, tool_call_parser="glm47", grammar_backend="none").structured
    with pytest.raises(APIError, match="grammar-backend none"):
        none.chat_fields(request, [TOOL], "required", "glm47", thinking)
