"""A tiny fake OpenAI-compatible + SGLang `/generate` server for testing `dsaserve bench`.

Run as `python tests/bench_fake_server.py`: it binds 127.0.0.1 on a port chosen by the OS, prints
the port on stdout, and serves until killed. `POST /fake/config` resets the request counter and
sets the behaviour (which request numbers fail, stall, drop the connection or send an error
frame; whether usage is streamed; tokens per frame; the reported accept length).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

DEFAULT_CONFIG: dict[str, Any] = {
    "fail_every": 0,  # request numbers divisible by this answer HTTP 500
    "stall_every": 0,  # ... send one chunk then hang
    "drop_every": 0,  # ... send one chunk then drop the connection
    "error_frame_every": 0,  # ... send one chunk then a `data: {"error": ...}` frame
    "tokens_per_frame": 1,
    "token_delay_s": 0.001,
    "usage": True,  # report usage / meta_info counts
    "send_done": True,  # end with `data: [DONE]`
    "accept_length": None,  # /get_server_info internal_states[0].avg_spec_accept_length
    "model_path": "",
    "reject_ignore_eos": False,  # answer 422 to ignore_eos, as `transformers serve` does
}

app = FastAPI()
state: dict[str, Any] = {"config": dict(DEFAULT_CONFIG), "count": 0}


def _mode() -> str:
    state["count"] += 1
    number, config = state["count"], state["config"]
    for mode in ("fail", "stall", "drop", "error_frame"):
        every = config[f"{mode}_every"]
        if every and number % every == 0:
            return mode
    return "ok"


def prompt_tokens(text: str) -> int:
    """The fake's prompt length: characters / 4, like the bench's no-tokenizer estimate."""
    return math.ceil(len(text) / 4)


@app.post("/fake/config")
async def set_config(request: Request) -> dict:
    state["config"] = {**DEFAULT_CONFIG, **(await request.json())}
    state["count"] = 0
    return state["config"]


@app.get("/v1/models")
async def models() -> dict:
    return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}


@app.get("/get_server_info")
async def server_info() -> dict:
    config = state["config"]
    info: dict[str, Any] = {"model_path": config["model_path"], "internal_states": [{}]}
    if config["accept_length"] is not None:
        info["internal_states"][0]["avg_spec_accept_length"] = config["accept_length"]
    return info


def _frame(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _openai_usage(prompt_len: int, done: int) -> dict:
    cached = prompt_len // 2
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": done,
        "total_tokens": prompt_len + done,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _chunk(kind: str, text: str, finish: str | None) -> dict:
    if kind == "chat":
        delta = {"content": text} if text else {}
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def _generate_frame(prompt_len: int, done: int, finish: bool, usage: bool) -> dict:
    meta: dict[str, Any] = {"finish_reason": {"type": "length"} if finish else None}
    if usage:
        meta |= {
            "prompt_tokens": prompt_len,
            "completion_tokens": done,
            "cached_tokens": prompt_len // 2,
            "spec_verify_ct": math.ceil(done / 2),
        }
    return {"text": " tok" * done, "meta_info": meta}


async def _misbehave(mode: str):
    if mode == "stall":
        await asyncio.sleep(3600)
    if mode == "drop":
        raise RuntimeError("fake server drops the connection")
    if mode == "error_frame":
        yield _frame({"error": {"message": "fake engine error", "code": 500}})


async def _stream(kind: str, prompt: str, max_tokens: int, mode: str, continuous: bool):
    config = state["config"]
    prompt_len, step, done = prompt_tokens(prompt), config["tokens_per_frame"], 0
    if kind == "chat":
        yield _frame({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    while done < max_tokens:
        await asyncio.sleep(config["token_delay_s"])
        new = min(step, max_tokens - done)
        done += new
        last = done == max_tokens
        if kind == "generate":
            yield _frame(_generate_frame(prompt_len, done, last, config["usage"]))
        else:
            body = _chunk(kind, " tok" * new, "length" if last else None)
            if config["usage"] and continuous:
                body["usage"] = _openai_usage(prompt_len, done)
            yield _frame(body)
        if mode != "ok":
            async for frame in _misbehave(mode):
                yield frame
            return
    if kind != "generate" and config["usage"]:
        yield _frame({"choices": [], "usage": _openai_usage(prompt_len, done)})
    if config["send_done"]:
        yield "data: [DONE]\n\n"


def _respond(kind: str, prompt: str, max_tokens: int, continuous: bool):
    mode = _mode()
    if mode == "fail":
        return JSONResponse({"error": {"message": "fake overload"}}, status_code=500)
    stream = _stream(kind, prompt, max_tokens, mode, continuous)
    return StreamingResponse(stream, media_type="text/event-stream")


def _max_tokens(max_tokens: int, ignore_eos: bool) -> int:
    return max_tokens if ignore_eos else max(1, max_tokens // 2)  # "EOS" halfway without it


@app.post("/v1/chat/completions")
async def chat(request: Request):
    body = await request.json()
    if state["config"]["reject_ignore_eos"] and "ignore_eos" in body:
        detail = "Unexpected fields in the request: {'ignore_eos'}"
        return JSONResponse({"detail": detail}, status_code=422)
    limit = _max_tokens(body["max_tokens"], body.get("ignore_eos", False))
    continuous = (body.get("stream_options") or {}).get("continuous_usage_stats", False)
    return _respond("chat", body["messages"][-1]["content"], limit, continuous)


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    limit = _max_tokens(body["max_tokens"], body.get("ignore_eos", False))
    return _respond("completions", body["prompt"], limit, False)


@app.post("/generate")
async def generate(request: Request):
    body = await request.json()
    params = body["sampling_params"]
    limit = _max_tokens(params["max_new_tokens"], params.get("ignore_eos", False))
    return _respond("generate", body["text"], limit, False)


def main() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
