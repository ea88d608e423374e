"""The embedded default model: checkpoint layout, tokenizer, chat template and a few behaviours.

Loads the committed checkpoint with transformers (DSA top-k active: prompts here exceed
index_topk) and checks greedy generations of the trained kinds.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, GenerationConfig, GlmMoeDsaForCausalLM

from dsaserve.assets import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from default_model_data import SEARCH_TOOL as SEARCH  # noqa: E402  (the tools it was trained on)
from default_model_data import WEATHER_TOOL as WEATHER  # noqa: E402
from default_model_data import Generator  # noqa: E402
from eval_default_model import eval_percent  # noqa: E402

MODEL_DIR = default_model_path()
SPECIAL = [
    "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
    "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "<tool_response>", "</tool_response>", "<|endoftext|>",
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GlmMoeDsaForCausalLM.from_pretrained(MODEL_DIR).eval()


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((MODEL_DIR / "config.json").read_text())


def render(tokenizer, messages, tools=None, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
    )


def generate_ids(model, tokenizer, messages, tools=None, **kwargs) -> tuple[list[int], list[int]]:
    prompt = tokenizer(render(tokenizer, messages, tools, **kwargs), add_special_tokens=False)
    ids = torch.tensor([prompt["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=120, do_sample=False, top_p=None, temperature=None)
    return prompt["input_ids"], out[0, ids.shape[1] :].tolist()


# ---- checkpoint -------------------------------------------------------------------------------


def test_checkpoint_size_under_40mb():
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= 40 * 1024 * 1024


def test_config_has_every_glm5_part(config, tokenizer):
    assert config["model_type"] == "glm_moe_dsa"
    assert config["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert config["q_lora_rank"] > 0 and config["kv_lora_rank"] > 0
    assert config["qk_rope_head_dim"] > 0 and config["qk_nope_head_dim"] > 0
    assert 32 <= config["index_topk"] <= 64 and config["index_n_heads"] >= 8
    assert config["n_routed_experts"] >= 8 and config["num_experts_per_tok"] >= 2
    assert config["n_shared_experts"] == 1 and config["first_k_dense_replace"] == 1
    assert config["num_hidden_layers"] >= 2 and config["num_nextn_predict_layers"] == 1
    assert config["max_position_embeddings"] >= 65536
    assert config["rope_parameters"]["rope_type"] == "default"
    assert config["tie_word_embeddings"] is False
    stops = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    assert config["eos_token_id"] == stops


def test_generation_config_defaults(tokenizer):
    gen = GenerationConfig.from_pretrained(MODEL_DIR)
    assert gen.temperature == 1.0 and gen.top_p == 0.95
    stops = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    assert list(gen.eos_token_id) == stops


def test_mtp_layer_saved_glm_style(config):
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    prefix = f"model.layers.{layers}."
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        shapes = {
            k[len(prefix) :]: f.get_slice(k).get_shape() for k in f.keys() if k.startswith(prefix)
        }
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_a_proj.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "self_attn.indexer.wq_b.weight",
                 "self_attn.indexer.wk.weight", "self_attn.indexer.weights_proj.weight",
                 "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                 "mlp.shared_experts.gate_proj.weight"):  # fmt: skip
        assert name in shapes, name
    assert shapes["eh_proj.weight"] == [hidden, 2 * hidden]
    assert shapes["mlp.experts.gate_up_proj"] == [experts, 2 * inter, hidden]
    assert shapes["mlp.experts.down_proj"] == [experts, hidden, inter]
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in shapes)


def test_transformers_loads_main_weights(model):
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        saved = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")
    loaded = model.model.layers[1].mlp.experts.gate_up_proj
    assert loaded.dtype == torch.float32  # bf16-stored matrices, fp32 model (config dtype)
    assert torch.equal(loaded, saved.float())
    assert len(model.model.layers) == model.config.num_hidden_layers


# ---- tokenizer and template --------------------------------------------------------------------


def test_special_tokens_are_single_ids(tokenizer):
    for token in SPECIAL:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids)[0] == token
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token == "<|endoftext|>"
    digits = tokenizer.tokenize("31415926")
    assert digits == list("31415926")


def test_template_tools_block_then_system_then_effort(tokenizer):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = render(tokenizer, msgs, [WEATHER], reasoning_effort="high")
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools\n\n")
    assert json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in text
    assert text.endswith(
        "<arg_value>{arg-value-2}</arg_value>...</tool_call>"
        "<|system|>S<|system|>Reasoning Effort: High<|user|>U<|assistant|><think>"
    )
    assert "Reasoning Effort" not in render(tokenizer, msgs, reasoning_effort="medium")
    off = render(tokenizer, msgs, reasoning_effort="max", enable_thinking=False)
    assert off.endswith("<|system|>S<|user|>U<|assistant|><think></think>")
    assert render(tokenizer, msgs, reasoning_effort="low").endswith(
        "<|system|>S<|system|>Reasoning Effort: Low<|user|>U<|assistant|><think>"
    )


def test_template_history_tool_calls_and_results(tokenizer):
    call = {"name": "search", "arguments": {"query": "jazz", "max_results": 2, "x": {"a": [1]}}}
    msgs = [
        {"role": "user", "content": "U1"},
        {"role": "assistant", "reasoning_content": "R1", "content": "",
         "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "A"},
        {"role": "tool", "content": "B"},
        {"role": "assistant", "content": "<think>R2</think>done"},
        {"role": "user", "content": "U2"},
    ]  # fmt: skip
    kept = render(tokenizer, msgs)
    assert kept == (
        "[gMASK]<sop><|user|>U1<|assistant|><think>R1</think><tool_call>search"
        "<arg_key>query</arg_key><arg_value>jazz</arg_value>"
        "<arg_key>max_results</arg_key><arg_value>2</arg_value>"
        '<arg_key>x</arg_key><arg_value>{"a": [1]}</arg_value></tool_call>'
        "<|observation|><tool_response>A</tool_response><tool_response>B</tool_response>"
        "<|assistant|><think>R2</think>done<|user|>U2<|assistant|><think>"
    )
    cleared = render(tokenizer, msgs, clear_thinking=True)
    assert "R1" not in cleared and "R2" not in cleared
    assert "<|assistant|><think></think><tool_call>search" in cleared


# ---- behaviour (greedy, DSA top-k active) ------------------------------------------------------

CALL_RE = re.compile(
    r"<tool_call>([^<]*)((?:<arg_key>.*?</arg_key><arg_value>.*?</arg_value>)*)</tool_call>", re.S
)
ARG_RE = re.compile(r"<arg_key>(.*?)</arg_key><arg_value>(.*?)</arg_value>", re.S)


def split(tokenizer, ids: list[int]) -> tuple[str, str]:
    text = tokenizer.decode(ids, skip_special_tokens=False)
    reasoning, _, content = text.partition("</think>")
    return reasoning, content


def parse_calls(content: str, tools: list[dict]) -> list[dict]:
    """glm47-style: name, then values typed by the tool's JSON schema (json for non-strings)."""
    props = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in tools}
    calls = []
    for name, arg_text in CALL_RE.findall(content):
        assert name in props, f"unknown tool {name!r}"
        args = {}
        for key, value in ARG_RE.findall(arg_text):
            assert key in props[name], f"{name} has no argument {key!r}"
            kind = props[name][key]["type"]
            args[key] = value if kind == "string" else json.loads(value)
            assert kind != "integer" or isinstance(args[key], int)
        calls.append({"name": name, "arguments": args})
    return calls


def ask_percent(model, tokenizer, pct: int, number: int):
    msgs = [{"role": "user", "content": f"What is {pct}% of {number}?"}]
    prompt, out = generate_ids(model, tokenizer, msgs)
    return msgs, prompt, out


@pytest.mark.parametrize("pct,number", [(15, 240), (70, 830)])
def test_percentage_reasoning_format_and_rerender(model, tokenizer, pct, number):
    msgs, prompt, out = ask_percent(model, tokenizer, pct, number)
    reasoning, content = split(tokenizer, out)
    assert reasoning.strip(), "no reasoning before </think>"
    assert content.removesuffix("<|user|>").strip(), "no answer after </think>"
    assert "<think>" not in reasoning and out[-1] == tokenizer.convert_tokens_to_ids("<|user|>")
    # Sending the answer back as history reproduces the generated tokens (D29).
    history = msgs + [
        {"role": "assistant", "reasoning_content": reasoning,
         "content": content.removesuffix("<|user|>")},
        {"role": "user", "content": "Thanks!"},
    ]  # fmt: skip
    again = tokenizer(render(tokenizer, history), add_special_tokens=False)["input_ids"]
    assert again[: len(prompt) + len(out)] == prompt + out


def test_guide_percentage_answer_is_correct(model, tokenizer):
    _, _, out = ask_percent(model, tokenizer, 15, 240)
    _, content = split(tokenizer, out)
    assert re.findall(r"\d+(?:\.\d+)?", content)[-1] == "36", content


def test_held_out_percentages_meet_the_target(model, tokenizer):
    """Issue 4's target, >= 90% correct with reasoning, on the eval script's first 10 held-out
    questions (the model gets 96-97.5% of them right, not all: see its README)."""
    report = eval_percent(model, tokenizer, Generator(4321, "test"), 10)
    assert report["percent_correct"] >= 0.9, report["examples"]


def call_weather(model, tokenizer):
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    prompt, out = generate_ids(model, tokenizer, msgs, [WEATHER, SEARCH])
    reasoning, content = split(tokenizer, out)
    return msgs, prompt, out, reasoning, content


def test_tool_prompt_gives_a_parsable_call_that_rerenders(model, tokenizer):
    msgs, prompt, out, reasoning, content = call_weather(model, tokenizer)
    assert out[-1] == tokenizer.convert_tokens_to_ids("<|observation|>"), content
    calls = parse_calls(content, [WEATHER, SEARCH])
    assert len(calls) == 1, content
    assert content.removesuffix("<|observation|>").startswith("<tool_call>")
    history = msgs + [
        {"role": "assistant", "reasoning_content": reasoning, "content": "",
         "tool_calls": [{"type": "function", "function": calls[0]}]},
        {"role": "tool", "content": '{"result": 1}'},
    ]  # fmt: skip
    again = tokenizer(render(tokenizer, history, [WEATHER, SEARCH]), add_special_tokens=False)
    assert again["input_ids"][: len(prompt) + len(out)] == prompt + out


def test_weather_call_has_the_right_name_and_city(model, tokenizer):
    *_, content = call_weather(model, tokenizer)
    calls = parse_calls(content, [WEATHER, SEARCH])
    assert calls and calls[0]["name"] == "get_weather", content
    assert calls[0]["arguments"].get("city") == "Paris", content


def test_answer_after_tool_result_uses_it(model, tokenizer):
    result = {"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny"}
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "reasoning_content": "The user wants the weather in Paris. "
         "I will call get_weather.", "content": "", "tool_calls": [{"type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": json.dumps(result)},
    ]  # fmt: skip
    _, answer = generate_ids(model, tokenizer, history, [WEATHER, SEARCH])
    _, final = split(tokenizer, answer)
    assert "18 degrees" in final and "sunny" in final, final


def test_search_call_has_integer_argument(model, tokenizer):
    msgs = [{"role": "user", "content": "Find 3 results about black holes."}]
    _, out = generate_ids(model, tokenizer, msgs, [SEARCH, WEATHER], enable_thinking=False)
    text = tokenizer.decode(out, skip_special_tokens=False)
    calls = parse_calls(text, [SEARCH, WEATHER])
    assert calls == [{"name": "search", "arguments": {"query": "black holes", "max_results": 3}}]
