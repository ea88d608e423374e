"""Measure the default model on held-out synthetic prompts with transformers (greedy decoding).

Reports: % correct percentage answers (answer after `</think>`, reasoning non-empty), % tool
prompts giving a well-formed call with the right name and correctly typed arguments, % answers
after a tool response that use the response, the MTP layer's top-1 accuracy of token t+2, and
(`--json-percent`) % percentage questions asked for in JSON ("… Answer in JSON.", no grammar)
whose content is exactly `{"answer": N}` with the right N.
DSA top-k is on throughout (the config's index_topk). Run:
  python scripts/eval_default_model.py --model dsaserve/assets/default_model --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import default_model_fast as fast  # noqa: E402
from default_model_batches import batches, encode  # noqa: E402
from default_model_data import ALL_TOOLS, Generator, pct_trace, samples  # noqa: E402
from default_model_mtp import MtpLayer  # noqa: E402

TOOL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
ARG_RE = re.compile(r"<arg_key>(.*?)</arg_key><arg_value>(.*?)</arg_value>", re.S)


def parse_tool_calls(text: str, tools: list[dict]) -> list[dict]:
    """glm47-style parse: name, then args typed by the tool's JSON schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in tools}
    calls = []
    for block in TOOL_RE.findall(text):
        name = block.split("<arg_key>")[0].strip()
        args = {}
        for key, value in ARG_RE.findall(block):
            kind = schemas.get(name, {}).get(key.strip(), {}).get("type", "string")
            args[key.strip()] = value if kind == "string" else json.loads(value)
        calls.append({"name": name, "arguments": args})
    return calls


def split_reasoning(generated: str) -> tuple[str, str]:
    """The prompt ends with <think>, so everything before </think> is reasoning."""
    if "</think>" not in generated:
        return generated, ""
    reasoning, content = generated.split("</think>", 1)
    return reasoning, content


def generate(model, tokenizer, messages, tools, max_new_tokens: int = 160, **kwargs) -> str:
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, return_tensors="pt", return_dict=True,
        **kwargs,
    )["input_ids"]  # fmt: skip
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, top_p=None,
                         temperature=None)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)


def eval_percent(model, tokenizer, gen: Generator, count: int) -> dict:
    correct = 0
    examples = []
    for i in range(count):
        pct, number = gen.pct_pairs[i * 7 % len(gen.pct_pairs)]
        tools = ALL_TOOLS if i % 3 == 0 else None
        question = f"What is {pct}% of {number}?"
        text = generate(model, tokenizer, [{"role": "user", "content": question}], tools)
        reasoning, content = split_reasoning(text)
        answer = pct_trace(pct, number)[1]
        numbers = re.findall(r"\d+(?:\.\d+)?", content)
        ok = bool(reasoning.strip()) and bool(numbers) and numbers[-1] == answer
        correct += ok
        if len(examples) < 3 or not ok:
            examples.append({"q": question, "out": text, "ok": ok})
    return {"percent_correct": correct / count, "n": count, "examples": examples[:8]}


def eval_json_percent(model, tokenizer, gen: Generator, count: int) -> dict:
    correct, failures = 0, []
    for i in range(count):
        pct, number = gen.pct_pairs[i * 7 % len(gen.pct_pairs)]
        question = f"What is {pct}% of {number}? Answer in JSON."
        text = generate(model, tokenizer, [{"role": "user", "content": question}], None)
        reasoning, content = split_reasoning(text)
        want = json.dumps({"answer": int(pct_trace(pct, number)[1])}) + "<|user|>"
        ok = bool(reasoning.strip()) and content == want
        correct += ok
        if not ok:
            failures.append({"q": question, "out": text})
    return {"json_percent_correct": correct / count, "json_n": count,
            "json_failures": failures[:8]}  # fmt: skip


def eval_tools(model, tokenizer, gen: Generator, count: int) -> dict:
    good = answered = 0
    failures = []
    for i in range(count):
        cycle = [gen.weather_cycle, gen.time_cycle, gen.search_cycle][i % 3](thinking=i % 4 != 3)
        user, call, tool_msg, final = cycle
        kwargs = {} if i % 4 != 3 else {"enable_thinking": False}
        text = generate(model, tokenizer, [user], ALL_TOOLS, **kwargs)
        _, content = split_reasoning(text) if i % 4 != 3 else ("", text)
        expected = call["tool_calls"][0]["function"]
        try:
            calls = parse_tool_calls(content, ALL_TOOLS)
        except json.JSONDecodeError:
            calls = []
        ok = calls == [{"name": expected["name"], "arguments": expected["arguments"]}]
        ok = ok and text.endswith("<|observation|>")
        good += ok
        if not ok:
            failures.append({"q": user["content"], "out": text})
        follow = generate(model, tokenizer, [user, call, tool_msg], ALL_TOOLS, **kwargs)
        _, follow_content = split_reasoning(follow) if i % 4 != 3 else ("", follow)
        used = _uses_result(follow_content, json.loads(tool_msg["content"]))
        answered += used
        if not used:
            failures.append({"q": user["content"], "result": tool_msg["content"], "out": follow})
    return {"tool_call_correct": good / count, "answer_uses_result": answered / count,
            "n": count, "failures": failures[:8]}  # fmt: skip


def _uses_result(content: str, result: dict) -> bool:
    if "temperature" in result:
        return f"{result['temperature']} degrees" in content and result["condition"] in content
    if "time" in result:
        return result["time"] in content
    return all(r["title"] in content for r in result["results"])


@torch.no_grad()
def eval_mtp(model, model_dir: Path, tokenizer, count: int) -> dict:
    config = model.config
    mtp = MtpLayer(config)
    prefix = f"model.layers.{config.num_hidden_layers}."
    state = {k[len(prefix) :]: v for k, v in load_file(model_dir / "model.safetensors").items()
             if k.startswith(prefix)}  # fmt: skip
    mtp.load_state_dict(state, strict=True)
    mtp.eval()
    data = [encode(s, tokenizer) for s in samples(1234, "test", count)]
    hits = total = hits_all = total_all = 0
    import random

    stream = batches(data, 4096, random.Random(0), tokenizer.pad_token_id)
    seen = 0
    while seen < len(data):
        batch = next(stream)
        seen += batch.input_ids.shape[0]
        hidden = fast.forward(model, batch.input_ids, batch.attention_mask, sparse=True).hidden
        out, _ = mtp.draft(model, batch.input_ids, hidden, batch.attention_mask, sparse=True)
        pred = model.lm_head(out[:, :-1]).argmax(-1)
        target = batch.input_ids[:, 2:]
        right = pred == target
        target_mask = batch.loss_mask[:, 2:].bool()
        valid = batch.attention_mask[:, 2:].bool()
        hits += (right & target_mask).sum().item()
        total += target_mask.sum().item()
        hits_all += (right & valid).sum().item()
        total_all += valid.sum().item()
    return {
        "mtp_top1_t_plus_2_assistant_tokens": hits / total,
        "mtp_top1_t_plus_2_all_tokens": hits_all / total_all,
        "mtp_eval_tokens": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "dsaserve/assets/default_model",
    )
    parser.add_argument("--percent", type=int, default=100)
    parser.add_argument("--tools", type=int, default=60)
    parser.add_argument("--mtp-samples", type=int, default=400)
    parser.add_argument("--json-percent", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = GlmMoeDsaForCausalLM.from_pretrained(args.model).eval()
    start = time.time()
    report = {"index_topk": model.config.index_topk}
    gen = Generator(4321, "test")
    if args.percent:
        report |= eval_percent(model, tokenizer, gen, args.percent)
    if args.tools:
        report |= eval_tools(model, tokenizer, gen, args.tools)
    if args.json_percent:
        report |= eval_json_percent(model, tokenizer, Generator(4321, "test"), args.json_percent)
    if args.mtp_samples:
        report |= eval_mtp(model, args.model, tokenizer, args.mtp_samples)
    for question, tools in (
        ("What is 15% of 240?", None),
        ("What's the weather in Paris?", ALL_TOOLS),
    ):
        report[f"guide: {question}"] = generate(
            model, tokenizer, [{"role": "user", "content": question}], tools
        )
    report["eval_seconds"] = round(time.time() - start, 1)
    print(json.dumps(report, indent=2, ensure_ascii=False))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
