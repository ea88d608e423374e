"""`dsaserve bench` against a fake streaming server (tests/bench_fake_server.py) in a subprocess.

The fake server fails, stalls, drops or error-frames chosen request numbers, so the tests check
counts, failure reasons, token totals, per-token gaps, cache ratio and accept length in the
tool's JSON. Timing values are only checked for consistency (ordering), never for speed.
"""

from __future__ import annotations

import json
import math
import random
import select
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from server_harness import wait_for

from dsaserve.bench.backends import ChunkUpdate
from dsaserve.bench.client import StreamTracker
from dsaserve.bench.datasets import (
    BenchRequest,
    TokenCounter,
    random_requests,
    sample_len,
    shared_prefix_requests,
)
from dsaserve.bench.metrics import percentile
from dsaserve.bench.serving import BenchError, run
from dsaserve.bench.serving import main as bench_main

FAKE_SERVER = Path(__file__).with_name("bench_fake_server.py")
STAT_KEYS = ("ttft", "itl", "tpot", "e2e_latency")


def _read_port(proc: subprocess.Popen, timeout: float) -> int:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError("fake server did not print its port in time")
    return int(proc.stdout.readline())


def _ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/v1/models", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def fake_server():
    proc = subprocess.Popen(
        [sys.executable, str(FAKE_SERVER)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        base_url = f"http://127.0.0.1:{_read_port(proc, 120.0)}"  # hang guard
        wait_for(lambda: _ready(base_url), "the fake server answering /v1/models")
        yield base_url
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _configure(base_url: str, **config) -> None:
    httpx.post(f"{base_url}/fake/config", json=config, timeout=5.0).raise_for_status()


def _run(base_url: str, tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "bench.jsonl"
    argv = ["--base-url", base_url, "--disable-progress", "--output-details"]
    argv += ["--output-file", str(out), "--random-range-ratio", "1", *flags]
    assert bench_main(argv) == 0
    return json.loads(out.read_text().splitlines()[-1])


def _numbers_hit(count: int, every: int, taken: set[int]) -> int:
    """How many of the fake's request numbers 2..count+1 (1 is the warmup) `every` selects."""
    hits = {n for n in range(2, count + 2) if n % every == 0} - taken
    taken |= hits
    return len(hits)


def _assert_stats_ordered(report: dict) -> None:
    for key in STAT_KEYS:
        median, p90, p99 = (report[f"{s}_{key}_ms"] for s in ("median", "p90", "p99"))
        assert 0 < median <= p90 <= p99, key
        assert report[f"mean_{key}_ms"] > 0
    assert report["mean_ttft_ms"] <= report["mean_e2e_latency_ms"]


def test_chat_counts_failures_tokens_cache_and_accept(fake_server, tmp_path):
    modes = {"fail_every": 5, "stall_every": 7, "drop_every": 9, "error_frame_every": 11}
    _configure(fake_server, accept_length=2.5, **modes)
    num, in_len, out_len, timeout = 24, 40, 6, 5.0  # well above a loaded answer, for the stalls
    flags = ["--backend", "openai-chat", "--num-prompts", str(num), "--random-input-len",
             str(in_len), "--random-output-len", str(out_len), "--max-concurrency", "4",
             "--timeout", str(timeout)]  # fmt: skip
    # a stalled request hangs for an hour: the run ending at all is the --timeout at work
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(_run(fake_server, tmp_path, *flags))
        except BaseException as e:  # re-raised below, in the test's thread
            outcome.append(e)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=600)  # hang guard
    assert outcome, "the run never ended: --timeout did not end the stalled requests"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    report = outcome[0]

    taken: set[int] = set()
    expected = {kind: _numbers_hit(num, every, taken) for kind, every in modes.items()}
    assert report["errors"] == {
        "HTTP 500": expected["fail_every"],
        f"timeout after {timeout:g}s": expected["stall_every"],
        "RemoteProtocolError": expected["drop_every"],
        "error frame": expected["error_frame_every"],
    }
    completed = num - sum(expected.values())
    assert (report["completed"], report["failed"]) == (completed, num - completed)
    assert report["total_output_tokens"] == completed * out_len  # ignore_eos was sent
    assert report["total_input_tokens"] == completed * in_len
    assert report["cached_token_ratio"] == pytest.approx((in_len // 2) / in_len)
    assert report["accept_length"] == 2.5
    assert report["model"] == "fake-model"
    _assert_stats_ordered(report)
    for request in report["requests"]:
        if request["success"]:
            assert len(request["itl"]) == out_len - 1  # one gap per token after the first
            assert request["ttft"] <= request["latency"]


def test_generate_splits_multi_token_frames_and_reads_request_accept(fake_server, tmp_path):
    _configure(fake_server, tokens_per_frame=2)
    out_len = 8
    report = _run(
        fake_server, tmp_path, "--backend", "generate", "--num-prompts", "6",
        "--random-input-len", "16", "--random-output-len", str(out_len), "--request-rate", "200",
        "--dataset", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "32",
        "--suffix-len", "8",
    )  # fmt: skip
    assert (report["completed"], report["failed"]) == (6, 0)
    assert report["total_output_tokens"] == 6 * out_len
    for request in report["requests"]:
        assert len(request["itl"]) == out_len - 2  # first frame carried 2 tokens
    # no accept length in /get_server_info: completion_tokens / spec_verify_ct per request
    assert report["accept_length"] == pytest.approx(2.0)
    assert report["cached_token_ratio"] == pytest.approx(0.5, abs=0.05)
    _assert_stats_ordered(report)


def test_completions_without_usage_or_done_counts_chunks(fake_server, tmp_path):
    _configure(fake_server, usage=False, send_done=False)
    report = _run(
        fake_server, tmp_path, "--backend", "openai-completions", "--num-prompts", "4",
        "--random-input-len", "20", "--random-output-len", "5", "--model", "named-model",
    )  # fmt: skip
    assert (report["completed"], report["failed"]) == (4, 0)
    assert report["total_output_tokens"] == 4 * 5
    assert report["total_input_tokens"] == 4 * 20  # the chars/4 estimate of the prompts
    assert report["cached_token_ratio"] is None and report["accept_length"] is None
    assert report["model"] == "named-model"


def test_missing_done_without_finish_is_a_failure(fake_server, tmp_path):
    _configure(fake_server, drop_every=2, send_done=False)
    report = _run(
        fake_server, tmp_path, "--backend", "openai-chat", "--num-prompts", "2",
        "--random-input-len", "8", "--random-output-len", "4", "--warmup-requests", "0",
    )  # fmt: skip
    assert report["completed"] == 1 and report["failed"] == 1


def test_ignore_eos_rejection_hints_and_can_be_disabled(fake_server, tmp_path, capsys):
    _configure(fake_server, reject_ignore_eos=True)
    argv = ["--base-url", fake_server, "--num-prompts", "2", "--disable-progress"]
    assert bench_main(argv + ["--random-input-len", "8", "--random-output-len", "2"]) == 1
    assert "--disable-ignore-eos" in capsys.readouterr().err
    report = _run(
        fake_server, tmp_path, "--num-prompts", "2", "--random-input-len", "8",
        "--random-output-len", "6", "--disable-ignore-eos",
    )  # fmt: skip
    assert report["completed"] == 2 and report["total_output_tokens"] == 2 * 3  # "EOS" at half


def test_unreachable_server_fails_every_request_and_ends(tmp_path):
    with __import__("socket").socket() as sock:  # bound (nobody else takes it), never listening
        sock.bind(("127.0.0.1", 0))
        report = _run(
            f"http://127.0.0.1:{sock.getsockname()[1]}", tmp_path, "--model", "m",
            "--warmup-requests", "0", "--num-prompts", "3", "--random-input-len", "8",
            "--random-output-len", "4", "--timeout", "5",
        )  # fmt: skip
    assert (report["completed"], report["failed"]) == (0, 3)
    assert report["errors"] == {"ConnectError": 3}
    assert report["mean_ttft_ms"] is None


def test_failed_warmup_exits_nonzero(fake_server, tmp_path):
    _configure(fake_server, fail_every=1)
    argv = ["--base-url", fake_server, "--num-prompts", "2", "--disable-progress"]
    assert bench_main(argv + ["--random-input-len", "8", "--random-output-len", "2"]) == 1


def test_run_returns_the_record_for_scripts(fake_server):
    _configure(fake_server)
    flags = ["--base-url", fake_server, "--disable-progress", "--random-output-len", "2"]
    record = run(flags + ["--num-prompts", "2", "--random-input-len", "8"])
    assert record["completed"] == 2 and record["args"]["num_prompts"] == 2
    _configure(fake_server, fail_every=1)
    with pytest.raises(BenchError, match="warmup"):
        run(flags + ["--num-prompts", "1"])


def test_cli_table_output(fake_server, tmp_path):
    _configure(fake_server, accept_length=3.25)
    proc = subprocess.run(
        [
            sys.executable, "-m", "dsaserve.cli", "bench", "--base-url", fake_server,
            "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "3",
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Successful requests:" in proc.stdout and "P99 TTFT (ms):" in proc.stdout
    assert "3.25" in proc.stdout
    assert "3/3" in proc.stderr  # the progress bar


@pytest.mark.parametrize(
    "flag,value", [("--num-prompts", "0"), ("--request-rate", "-1"), ("--timeout", "0")]
)
def test_invalid_flags_are_rejected(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main([flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_percentile_interpolates_like_numpy():
    values = [random.Random(0).random() for _ in range(17)]
    ordered = sorted(values)
    assert percentile(values, 0) == ordered[0] and percentile(values, 100) == ordered[-1]
    assert percentile(values, 50) == ordered[8]
    assert percentile([1.0, 2.0], 25) == pytest.approx(1.25)
    assert math.isnan(percentile([], 50))


def test_tracker_splits_frames_by_reported_counts():
    tracker = StreamTracker(start=0.0, cumulative_text=False)
    tracker.on_update(0.0, ChunkUpdate(text="", completion_tokens=0))  # role chunk
    tracker.on_update(1.0, ChunkUpdate(text="a", completion_tokens=1))
    tracker.on_update(4.0, ChunkUpdate(text="bcd", completion_tokens=4))
    tracker.on_update(4.5, ChunkUpdate(text="", completion_tokens=4, finished=True))
    result = tracker.result(BenchRequest("p", 1, 4), end=5.0, counter=TokenCounter())
    assert result.ttft == 1.0 and result.itl == [1.0, 1.0, 1.0]
    assert result.output_len == 4 and result.latency == 5.0


def test_tracker_counts_uncounted_text_frames_and_final_usage():
    tracker = StreamTracker(start=0.0, cumulative_text=True)
    for step, text in enumerate(["x", "xy", "xyz"], start=1):
        tracker.on_update(float(step), ChunkUpdate(text=text))
    tracker.on_update(3.5, ChunkUpdate(completion_tokens=3, finished=True))
    result = tracker.result(BenchRequest("p", 1, 3), end=4.0, counter=TokenCounter())
    assert result.itl == [1.0, 1.0] and result.output_len == 3
    assert result.generated_text == "xyz"


def test_random_dataset_lengths_without_tokenizer():
    requests = random_requests(50, 64, 32, 0.5, TokenCounter(), seed=3)
    assert requests == random_requests(50, 64, 32, 0.5, TokenCounter(), seed=3)
    assert all(32 <= r.prompt_len <= 64 and 16 <= r.output_len <= 32 for r in requests)
    assert all(r.prompt_len == math.ceil(len(r.prompt) / 4) for r in requests)
    assert len({r.prompt for r in requests}) == 50


def test_shared_prefix_dataset_shares_prefixes():
    requests = shared_prefix_requests(12, 3, 40, 10, 8, 1.0, TokenCounter(), seed=0)
    prefixes = {r.prompt.split("\n\n")[0] for r in requests}
    assert len(prefixes) == 3 and len({r.prompt for r in requests}) == 12
    assert all(r.output_len == 8 for r in requests)


def test_sample_len_bounds():
    rng = random.Random(0)
    lengths = [sample_len(rng, 10, 0.3) for _ in range(200)]
    assert min(lengths) == 3 and max(lengths) == 10


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A 300-token byte-level BPE tokenizer trained in a fraction of a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=alphabet
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(path)
    return path


def test_random_dataset_with_tokenizer_has_exact_lengths(tiny_tokenizer_dir):
    from dsaserve.bench.datasets import load_tokenizer

    counter = TokenCounter(load_tokenizer(str(tiny_tokenizer_dir)), str(tiny_tokenizer_dir))
    requests = random_requests(30, 48, 8, 1.0, counter, seed=5)
    assert all(r.prompt_len == counter.count(r.prompt) for r in requests)
    assert all(44 <= r.prompt_len <= 48 for r in requests)  # re-encoding loses little
    assert "<eos>" not in "".join(r.prompt for r in requests)


def test_tokenizer_comes_from_server_model_path(fake_server, tmp_path, tiny_tokenizer_dir):
    _configure(fake_server, model_path=str(tiny_tokenizer_dir))
    report = _run(
        fake_server, tmp_path, "--num-prompts", "2", "--random-input-len", "16",
        "--random-output-len", "2",
    )  # fmt: skip
    assert report["tokenizer"] == str(tiny_tokenizer_dir)
    assert report["completed"] == 2


def test_bad_tokenizer_flag_is_an_error(fake_server, tmp_path):
    argv = ["--base-url", fake_server, "--tokenizer", str(tmp_path / "missing")]
    assert bench_main(argv + ["--disable-progress"]) == 2


@pytest.mark.parametrize("backend", ["openai-chat", "openai-completions", "generate"])
def test_against_the_real_server(main_server, tmp_path, backend):
    """A tiny shared-prefix workload on `dsaserve serve` (random weights): all complete,
    `ignore_eos` is honoured, the tokenizer comes from /get_server_info, cache hits show."""
    num, out_len = 6, 4
    report = _run(
        main_server.url, tmp_path, "--backend", backend, "--num-prompts", str(num),
        "--dataset", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "64",
        "--suffix-len", "8", "--random-output-len", str(out_len), "--max-concurrency", "1",
        "--timeout", "120",
    )  # fmt: skip
    assert (report["completed"], report["failed"]) == (num, 0), report["error_examples"]
    assert report["total_output_tokens"] == num * out_len
    assert report["model"] == "glm-test"
    assert report["tokenizer"] not in (None, "chars/4 estimate")
    assert report["total_input_tokens"] >= num * 64
    assert report["cached_token_ratio"] > 0.3  # each prefix is computed once, then reused
    _assert_stats_ordered(report)
