"""HiCache's storage tier: a restarted engine reads its pages back bit-exactly; damaged, foreign,
unwritable or missing storage is logged and recomputed, and the engine keeps serving."""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
from speculative_models import make_mtp_checkpoint
from test_hicache import GREEDY, PAGE, A, B, check_tree, result

from dsaserve import LLM
from dsaserve.engine.kvcache import codec as hicache_codec
from dsaserve.engine.kvcache import storage as hicache_storage
from dsaserve.engine.kvcache.storage import FileBackend
from dsaserve.engine.messages import GenerateRequest

FIRST, SECOND = [A[0], B[0]], [A[1], B[1]]  # the second pair reuses the first pair's prefixes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_mtp_checkpoint(tmp_path_factory.mktemp("store") / "ckpt", "glm", seed=4))


@pytest.fixture(scope="module")
def expected(checkpoint):
    """FIRST then SECOND on one engine whose device pool keeps everything (hierarchy off)."""
    llm = LLM(checkpoint, page_size=PAGE, max_total_tokens=4096, speculative_algorithm="EAGLE")
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in FIRST + SECOND]
    return result(outs[2:])


def assert_recomputed_ok(outs, expected, atol: float = 1e-5) -> None:
    """Same tokens; logprobs within fp32 rounding (part of the prefix was recomputed, so its KV
    comes from a different pass than in `expected`)."""
    assert [o.token_ids for o in outs] == [tokens for tokens, _ in expected]
    for out, (_, logprobs) in zip(outs, expected):
        assert all(abs(lp.logprob - want[1]) <= atol for lp, want in zip(out.logprobs, logprobs))


def storage_llm(checkpoint: str, store: Path, policy: str = "wait_complete", **extra) -> LLM:
    config = {"file_path": str(store), "prefetch_threshold": PAGE, **extra}
    return LLM(checkpoint, page_size=PAGE, max_total_tokens=96, speculative_algorithm="EAGLE",
               enable_hierarchical_cache=True, hicache_storage_backend="file",
               hicache_storage_backend_extra_config=json.dumps(config),
               hicache_storage_prefetch_policy=policy)  # fmt: skip


def serve(llm: LLM, prompts: list[list[int]]) -> list:
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    llm.engine.cache.storage.drain()
    return outs


def fill_store(checkpoint: str, store: Path) -> None:
    llm = storage_llm(checkpoint, store)
    serve(llm, FIRST)
    assert llm.engine.stats()["hicache_storage_write_pages"] >= 16


@pytest.mark.parametrize("policy", ["wait_complete", "timeout", "best_effort"])
def test_restart_reads_storage_bit_exact(checkpoint, expected, tmp_path, policy):
    fill_store(checkpoint, tmp_path)
    restarted = storage_llm(checkpoint, tmp_path, policy)  # a new engine: empty device and host
    outs = serve(restarted, SECOND)
    assert result(outs) == expected  # tokens and logprobs, bit for bit
    assert [o.cached_tokens for o in outs] == [64, 64]
    stats = restarted.engine.stats()
    assert stats["hicache_storage_hit_tokens"] == 128
    assert stats["hicache_storage_rejected_pages"] == 0
    check_tree(restarted.engine.cache)


def test_storage_pages_round_trip_every_layer(checkpoint, tmp_path):
    llm = storage_llm(checkpoint, tmp_path)
    serve(llm, [A[0]])
    cache = llm.engine.cache
    pages, node = cache.match_prefix(A[0])
    slots = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])
    keys = cache.storage.codec.page_keys(A[0][: len(pages) * PAGE], PAGE)
    for i, key in enumerate(keys):
        page = cache.storage.read(key)
        page_slots = slots[i * PAGE : (i + 1) * PAGE]
        assert torch.equal(page.kv, llm.engine.pool.kv_cache[:, page_slots])  # MTP layer too
        assert torch.equal(page.index, llm.engine.pool.index_cache[:, page_slots])
    assert page.kv.shape[0] == llm.engine.model_config.num_hidden_layers + 1
    folder = cache.storage.backend.dir  # only this user reads or writes the pages and the key
    assert folder.stat().st_mode & 0o777 == 0o700 == tmp_path.stat().st_mode & 0o777
    files = [*folder.iterdir(), tmp_path / hicache_codec.KEY_FILE]
    assert len(files) > 8 and {f.stat().st_mode & 0o777 for f in files} == {0o600}


def test_default_directory_is_the_users_cache_not_tmp(monkeypatch, tmp_path):
    monkeypatch.delenv(hicache_storage.DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert hicache_storage.storage_root({}) == tmp_path / "dsaserve" / "hicache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert hicache_storage.storage_root({}) == Path.home() / ".cache" / "dsaserve" / "hicache"
    assert hicache_storage.storage_root({"file_path": "/x"}) == Path("/x")


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _garbage(path: Path) -> None:
    path.write_bytes(b"not a page at all")


def _split(blob: bytes) -> tuple[bytes, bytes]:
    """(header line, payload) of a stored page; the MAC line is the one after the magic."""
    body = blob[len(hicache_codec.MAGIC) + hicache_codec.MAC_HEX + 1 :]
    header, _, payload = body.partition(b"\n")
    return header, payload


def _forge(path: Path) -> None:
    """Other KV, with a fresh SHA-256 where the MAC goes: what a writer without the key can do."""
    header, payload = _split(path.read_bytes())
    body = header + b"\n" + bytes(payload[:-10]) + bytes(b ^ 0x55 for b in payload[-10:])
    path.write_bytes(hicache_codec.MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)


def _list_header(path: Path) -> None:
    """A header that is valid JSON but not an object, properly keyed (a buggy writer)."""
    key = (path.parent.parent / hicache_codec.KEY_FILE).read_bytes()
    body = b"[1, 2]\n" + _split(path.read_bytes())[1]
    mac = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    path.write_bytes(hicache_codec.MAGIC + mac + b"\n" + body)


DAMAGE = {"corrupt": (_flip, "not authenticated"), "truncated": (_truncate, "truncated"),
          "garbage": (_garbage, "bad magic"), "forged": (_forge, "not authenticated"),
          "list-header": (_list_header, "not a JSON object")}  # fmt: skip


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_page_is_skipped_logged_and_recomputed(checkpoint, expected, tmp_path, caplog,
                                                       kind):  # fmt: skip
    fill_store(checkpoint, tmp_path)
    llm = storage_llm(checkpoint, tmp_path)
    keys = llm.engine.cache.storage.codec.page_keys(A[1][:64], PAGE)
    damage, message = DAMAGE[kind]
    damage(llm.engine.cache.storage.backend.dir / f"{keys[3]}.kv")
    with caplog.at_level(logging.WARNING, logger="dsaserve.engine.kvcache.storage"):
        outs = serve(llm, SECOND)
    assert_recomputed_ok(outs, expected)
    assert [o.cached_tokens for o in outs] == [24, 64]  # pages before the bad one still load
    assert message in caplog.text and "skipped page" in caplog.text
    assert llm.engine.stats()["hicache_storage_rejected_pages"] == 1
    again = storage_llm(checkpoint, tmp_path)  # the recomputed page replaced the bad file
    assert [o.cached_tokens for o in serve(again, [A[2]])] == [64]


def test_other_model_never_reads_these_pages(checkpoint, tmp_path, tmp_path_factory, caplog):
    other_ckpt = str(make_mtp_checkpoint(tmp_path_factory.mktemp("other") / "c", "glm", seed=5))
    fill_store(checkpoint, tmp_path)
    other = storage_llm(other_ckpt, tmp_path)  # same config, other weights: own namespace
    alone = LLM(other_ckpt, page_size=PAGE, max_total_tokens=4096, speculative_algorithm="EAGLE")
    want = [alone.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in SECOND]
    assert [o.token_ids for o in serve(other, SECOND)] == want
    assert other.engine.stats()["hicache_storage_hit_tokens"] == 0
    # a file of ours renamed into its namespace under its key is refused, not loaded
    ours = storage_llm(checkpoint, tmp_path).engine.cache.storage
    theirs = other.engine.cache.storage
    our_key = ours.codec.page_keys(A[2][:8], PAGE)[0]
    their_key = theirs.codec.page_keys(A[2][:8], PAGE)[0]
    theirs.backend.discard(their_key)
    (theirs.backend.dir / f"{their_key}.kv").write_bytes(
        (ours.backend.dir / f"{our_key}.kv").read_bytes()
    )
    with caplog.at_level(logging.WARNING, logger="dsaserve.engine.kvcache.storage"):
        assert theirs.read(their_key) is None
    assert "foreign identity" in caplog.text


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC], ids=["read-only", "full"])
def test_unwritable_storage_logs_and_keeps_serving(checkpoint, expected, tmp_path, monkeypatch,
                                                   caplog, err):  # fmt: skip
    def fail(src, dst):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(hicache_storage.os, "replace", fail)
    llm = storage_llm(checkpoint, tmp_path)
    with caplog.at_level(logging.WARNING, logger="dsaserve.engine.kvcache.storage"):
        outs = serve(llm, FIRST + SECOND)
    assert result(outs[2:]) == expected
    assert "cannot write" in caplog.text and os.strerror(err) in caplog.text
    assert list(llm.engine.cache.storage.backend.dir.iterdir()) == []  # no temp files left


def test_missing_directory_is_created_and_unusable_one_turns_storage_off(
    checkpoint, expected, tmp_path, caplog
):
    created = storage_llm(checkpoint, tmp_path / "a" / "b")
    serve(created, FIRST)
    assert created.engine.stats()["hicache_storage_pages"] >= 16
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.ERROR, logger="dsaserve.engine.kvcache.storage"):
        llm = storage_llm(checkpoint, tmp_path / "file" / "sub")
    assert "cannot use" in caplog.text and "storage tier is off" in caplog.text
    outs = serve(llm, FIRST + SECOND)
    assert result(outs[2:]) == expected and llm.engine.stats()["hicache_storage_pages"] == 0


def test_size_cap_evicts_least_recently_used(checkpoint, tmp_path):
    probe = storage_llm(checkpoint, tmp_path / "probe")
    serve(probe, [A[0]])
    sizes = {f.stat().st_size for f in probe.engine.cache.storage.backend.dir.iterdir()}
    cap = 5.5 * max(sizes)
    llm = storage_llm(checkpoint, tmp_path / "capped", max_size_gb=cap / 2**30)
    serve(llm, FIRST + SECOND)
    backend = llm.engine.cache.storage.backend
    files = list(backend.dir.iterdir())
    assert len(files) == 5 and sum(f.stat().st_size for f in files) <= cap
    last = llm.engine.cache.storage.codec.page_keys(B[1][:72], PAGE)[-1]  # newest page kept
    assert (backend.dir / f"{last}.kv").is_file()


def test_leftover_temp_file_is_removed_never_loaded(checkpoint, tmp_path):
    fill_store(checkpoint, tmp_path)
    llm = storage_llm(checkpoint, tmp_path)
    folder = llm.engine.cache.storage.backend.dir
    key = llm.engine.cache.storage.codec.page_keys(A[1][:8], PAGE)[0]
    (folder / f".{key}.999.1.tmp").write_bytes(b"half a page")  # a crash mid-write
    restarted = storage_llm(checkpoint, tmp_path)
    assert not any(f.name.endswith(".tmp") for f in folder.iterdir())
    assert [o.cached_tokens for o in serve(restarted, [A[1]])] == [64]


class GatedFileBackend(FileBackend):
    """The `dynamic` seam in use: a file backend whose reads of the pages in `blocked` wait until
    the test calls `release()` (`waiting` is set once one does, `stuck` if none came); it counts
    the pages it read."""

    def __init__(self, extra: dict, namespace: str) -> None:
        super().__init__(extra["file_path"], namespace, 1 << 30)
        self.blocked: set[str] = set()
        self.waiting = threading.Event()
        self.released = threading.Event()
        self.reads = 0
        self.stuck = False

    def get(self, key: str) -> bytes | None:
        if key in self.blocked:
            self.waiting.set()
            self.stuck = not self.released.wait(120)  # hang guard
        self.reads += 1
        return super().get(key)

    def release(self) -> None:
        self.blocked.clear()
        self.released.set()


def gated_llm(checkpoint: str, store: Path, policy: str, **extra) -> LLM:
    config = {"file_path": str(store), "prefetch_threshold": PAGE, "module_path":
              "test_hicache_storage", "class_name": "GatedFileBackend", **extra}  # fmt: skip
    return LLM(checkpoint, page_size=PAGE, max_total_tokens=96, speculative_algorithm="EAGLE",
               enable_hierarchical_cache=True, hicache_storage_backend="dynamic",
               hicache_storage_backend_extra_config=json.dumps(config),
               hicache_storage_prefetch_policy=policy)  # fmt: skip


def block_page(llm: LLM, prompt: list[int], index: int) -> None:
    """Reads of `prompt`'s page `index` (from 0) wait for `release()`."""
    storage = llm.engine.cache.storage
    storage.backend.blocked.add(storage.codec.page_keys(prompt[: (index + 1) * PAGE], PAGE)[index])


def test_abort_in_the_middle_of_a_load(checkpoint, expected, tmp_path):
    fill_store(checkpoint, tmp_path)
    llm = gated_llm(checkpoint, tmp_path, "wait_complete")
    engine, cache, backend = llm.engine, llm.engine.cache, llm.engine.cache.storage.backend
    block_page(llm, A[1], 1)  # page 0 loads, page 1 waits
    engine.add_request(GenerateRequest(rid="x", input_ids=A[1], sampling={"max_tokens": 4}))
    assert engine.step() == []  # waiting on its prefetch
    handle = cache.prefetches["x"][1]
    assert backend.waiting.wait(120)  # hang guard
    assert len(handle.pages) == 1 and not handle.done.is_set()
    assert engine.abort("x").finish_reason["type"] == "abort"
    backend.release()
    assert handle.done.wait(120)  # hang guard
    assert len(handle.pages) == 2 and backend.reads == 2  # stopped after the read in progress
    assert not cache.prefetches and not engine.has_work()
    assert engine.pool.pages.num_free == engine.pool.pages.num_pages
    check_tree(cache)
    outs = serve(llm, SECOND)
    assert result(outs) == expected and [o.cached_tokens for o in outs] == [64, 64]


def test_timeout_policy_admits_with_the_pages_read_so_far(checkpoint, expected, tmp_path):
    fill_store(checkpoint, tmp_path)
    # the timeout is the policy's, not a bound on the test: two page reads fit in it easily
    llm = gated_llm(checkpoint, tmp_path, "timeout", prefetch_timeout_base=5.0,
                    prefetch_timeout_per_ki_token=0.0)  # fmt: skip
    for prompt in SECOND:
        block_page(llm, prompt, 2)  # pages 0 and 1 load, page 2 waits past the timeout
    try:
        outs = serve(llm, SECOND)
    finally:
        llm.engine.cache.storage.backend.release()
    assert_recomputed_ok(outs, expected)
    assert [o.cached_tokens for o in outs] == [2 * PAGE, 2 * PAGE]
    assert not llm.engine.cache.storage.backend.stuck  # admitted at the timeout, not at a release
    check_tree(llm.engine.cache)
