"""Measure the default model through a running dsaserve server with the official openai SDK.

Same held-out prompts as scripts/eval_default_model.py (Generator(4321, "test")), greedy:
- percentage: correct iff `reasoning_content` is non-empty and the last number in `content`
  is the answer (tools offered on every third prompt);
- tools: exactly one parsed call with the expected name and typed arguments, finish_reason
  "tool_calls"; then, after the tool response, the final answer uses the result;
- JSON answers (`--json-percent`): the same percentage questions, no JSON asked for in the
  prompt, under `response_format` json_schema: `{"answer": number}` with thinking on, and
  `{"reasoning": string, "answer": number}` with thinking off; correct iff the content
  validates and its answer is the right number;
- the guide's two examples (15% of 240; weather in Paris), reported separately.
Starts `dsaserve serve` on a free port (tests/server_harness.py: always stopped) unless --base-url:
  python scripts/eval_default_model_server.py --percent 40 --tools 24 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

import jsonschema
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_data import ALL_TOOLS, WEATHER_TOOL, Generator, pct_trace  # noqa: E402
from eval_default_model import _uses_result  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_harness import running_server  # noqa: E402  (one server starter/stopper)

NUMBER = re.compile(r"\d+(?:\.\d+)?")
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


ANSWER = {"type": "object", "properties": {"answer": {"type": "number"}}, "required": ["answer"]}
REASONED = {"type": "object", "required": ["reasoning", "answer"], "properties": {
    "reasoning": {"type": "string", "maxLength": 400}, "answer": {"type": "number"}}}  # fmt: skip


def chat(client: OpenAI, messages: list, tools=None, extra=None, max_tokens: int = 200, fmt=None):
    kw = {"tools": tools} if tools else {}
    if fmt is not None:
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": fmt}}
    reply = client.chat.completions.create(
        model="default",
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
        extra_body=extra,
        **kw,
    )
    choice = reply.choices[0]
    msg = choice.message
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []
    ]
    return {
        "reasoning": getattr(msg, "reasoning_content", None) or "",
        "content": msg.content or "",
        "tool_calls": calls,
        "finish_reason": choice.finish_reason,
    }


def percent_ok(out: dict, answer: str) -> bool:
    numbers = NUMBER.findall(out["content"])
    return bool(out["reasoning"].strip()) and bool(numbers) and numbers[-1] == answer


def typed_args(arguments: str | None) -> dict | None:
    """The call's arguments with each value's type (`==` alone takes 2.0 or True for 2 or 1)."""
    try:
        parsed = json.loads(arguments or "")
    except json.JSONDecodeError:
        return None
    return (
        {k: (type(v).__name__, v) for k, v in parsed.items()} if isinstance(parsed, dict) else None
    )


def call_ok(out: dict, name: str, args: dict) -> bool:
    if out["finish_reason"] != "tool_calls" or len(out["tool_calls"]) != 1:
        return False
    call = out["tool_calls"][0]
    return call["name"] == name and typed_args(call["arguments"]) == typed_args(json.dumps(args))


def eval_percent(client: OpenAI, gen: Generator, count: int) -> dict:
    correct, failures = 0, []
    for i in range(count):
        pct, number = gen.pct_pairs[i * 7 % len(gen.pct_pairs)]
        question = f"What is {pct}% of {number}?"
        out = chat(
            client, [{"role": "user", "content": question}], ALL_TOOLS if i % 3 == 0 else None
        )
        ok = percent_ok(out, pct_trace(pct, number)[1])
        correct += ok
        if not ok:
            failures.append({"q": question, "expected": pct_trace(pct, number)[1], **out})
    return {
        "percent_correct": correct / count,
        "percent_n": count,
        "percent_failures": failures[:8],
    }


def json_ok(out: dict, schema: dict, answer: str) -> bool:
    try:
        value = json.loads(out["content"])
        jsonschema.validate(value, schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return value["answer"] == float(answer)


def eval_json_percent(client: OpenAI, gen: Generator, count: int) -> dict:
    report = {"json_percent_n": count}
    for key, schema, extra in (
        ("json_answer", ANSWER, None),
        ("json_reasoned", REASONED, NO_THINK),
    ):
        correct, failures = 0, []
        for i in range(count):
            pct, number = gen.pct_pairs[i * 7 % len(gen.pct_pairs)]
            question = [{"role": "user", "content": f"What is {pct}% of {number}?"}]
            out = chat(client, question, ALL_TOOLS if i % 3 == 0 else None, extra, 300, schema)
            ok = json_ok(out, schema, pct_trace(pct, number)[1])
            correct += ok
            if not ok:
                failures.append({"q": question[0]["content"], **out})
        report |= {f"{key}_correct": correct / count, f"{key}_failures": failures[:8]}
    return report


def eval_tools(client: OpenAI, gen: Generator, count: int) -> dict:
    good = answered = 0
    call_failures, answer_failures = [], []
    for i in range(count):
        cycle = [gen.weather_cycle, gen.time_cycle, gen.search_cycle][i % 3](thinking=i % 4 != 3)
        user, call, tool_msg, _ = cycle
        extra = NO_THINK if i % 4 == 3 else None
        expected = call["tool_calls"][0]["function"]
        out = chat(client, [user], ALL_TOOLS, extra)
        ok = call_ok(out, expected["name"], expected["arguments"])
        good += ok
        if not ok:
            call_failures.append({"q": user["content"], "expected": expected, **out})
        call_id = f"call_{i}"
        assistant = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": expected["name"],
                        "arguments": json.dumps(expected["arguments"]),
                    },
                }
            ],
        }
        if call.get("reasoning_content"):
            assistant["reasoning_content"] = call["reasoning_content"]
        tool = {"role": "tool", "tool_call_id": call_id, "content": tool_msg["content"]}
        follow = chat(client, [user, assistant, tool], ALL_TOOLS, extra)
        used = _uses_result(follow["content"], json.loads(tool_msg["content"]))
        answered += used
        if not used:
            answer_failures.append({"q": user["content"], "result": tool_msg["content"], **follow})
    return {
        "tool_call_correct": good / count,
        "answer_uses_result": answered / count,
        "tools_n": count,
        "tool_call_failures": call_failures[:8],
        "answer_failures": answer_failures[:8],
    }


def eval_guide(client: OpenAI) -> dict:
    pct = chat(client, [{"role": "user", "content": "What is 15% of 240?"}])
    paris = chat(
        client, [{"role": "user", "content": "What's the weather in Paris?"}], [WEATHER_TOOL]
    )
    paris_ok = paris["finish_reason"] == "tool_calls" and any(
        c["name"] == "get_weather"
        and (typed_args(c["arguments"]) or {}).get("city") == ("str", "Paris")
        for c in paris["tool_calls"]
    )
    return {
        "guide_15pct_of_240_ok": percent_ok(pct, "36"),
        "guide_weather_paris_ok": paris_ok,
        "guide_15pct_of_240": pct,
        "guide_weather_paris": paris,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: embedded model)")
    parser.add_argument("--base-url", help="evaluate this running server, e.g. http://host:30000")
    parser.add_argument("--percent", type=int, default=40)
    parser.add_argument("--tools", type=int, default=24)
    parser.add_argument("--json-percent", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for the server")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.base_url:
            url = args.base_url.rstrip("/").removesuffix("/v1")
        else:
            env = {"OMP_NUM_THREADS": str(args.threads)}
            url = stack.enter_context(running_server(args.model, env=env)).url
        client = OpenAI(base_url=url + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "none"))
        start = time.time()
        gen = Generator(4321, "test")
        report = {"base_url": url}
        if args.percent:
            report |= eval_percent(client, gen, args.percent)
        if args.tools:
            report |= eval_tools(client, gen, args.tools)
        if args.json_percent:
            report |= eval_json_percent(client, Generator(4321, "test"), args.json_percent)
        report |= eval_guide(client)
        report["eval_seconds"] = round(time.time() - start, 1)
    rows = [
        ("percentage correct (reasoning non-empty)", "percent_correct", "percent_n", ">= 90%"),
        ("tool call right name + typed args", "tool_call_correct", "tools_n", ">= 95%"),
        ("answer after tool response uses it", "answer_uses_result", "tools_n", "-"),
        ("JSON {answer} right, thinking on", "json_answer_correct", "json_percent_n", "-"),
        (
            "JSON {reasoning, answer} right, thinking off",
            "json_reasoned_correct",
            "json_percent_n",
            "-",
        ),
    ]
    print(f"{'metric':48} {'n':>4} {'rate':>7}  target")
    for label, key, n, target in rows:
        if key in report:
            print(f"{label:48} {report[n]:>4} {report[key]:>7.1%}  {target}")
    print(
        f"guide 15% of 240 -> 36: {report['guide_15pct_of_240_ok']}   "
        f"guide weather in Paris -> get_weather(Paris): {report['guide_weather_paris_ok']}"
    )
    print(f"eval seconds: {report['eval_seconds']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
