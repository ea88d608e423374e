"""HiCache's storage tier (L3): KV pages in files that outlive the server.

A page is stored as one framed blob: a magic line, a JSON header (format, model identity, key,
tensor shapes, dtype, SHA-256 of the payload), then the payload: the page's MLA entry in every
layer (the MTP layer included) and its indexer key in every indexer layer. A page's key chains
the SHA-256 of the model identity and every token up to the page's end, so a key names one prefix
of one model. A blob that fails any check (truncated, checksum, foreign identity, wrong key or
shape) is logged and skipped, never loaded.

Seam: `StorageBackend` stores opaque blobs by key (`exists`, `get`, `set`, `clear`). `file` is a
directory backend (atomic tmp + rename writes, a size cap with LRU eviction); `dynamic` loads a
user class named in `--hicache-storage-backend-extra-config` (`module_path`, `class_name`).
`StorageTier` frames pages and runs writes and prefetches on background threads.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import json
import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

MAGIC = b"DSAKV1\n"
FORMAT_VERSION = 1
DEFAULT_DIR = "/tmp/hicache"  # SGLang's HiCacheFile default
DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # SGLang's variable for the file backend
DEFAULT_MAX_SIZE_GB = 10.0
EXIT_DRAIN_S = 10.0  # how long a normal exit waits for queued writes (then they are dropped)


class PageTensors(NamedTuple):
    kv: torch.Tensor  # [layers, page_size, kv_entry_dim]: latent || rope, MTP layer last
    index: torch.Tensor  # [index_layers, page_size, index_head_dim]


class StorageBackend(ABC):
    """Where framed page blobs live. Implementations must be thread-safe; a failure is a
    logged False/None, never an exception that reaches the engine."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def set(self, key: str, blob: bytes) -> bool: ...

    def discard(self, key: str) -> None:  # noqa: B027 (optional)
        """Forget a page that failed its checks, so a good copy can be written."""

    def clear(self) -> None:  # noqa: B027 (optional)
        """Drop every stored page (not called by /flush_cache: storage persists)."""

    def describe(self) -> dict:
        return {}


class FileBackend(StorageBackend):
    """One file per page in `<root>/<identity[:16]>/`, written to a temporary name and renamed,
    capped at `max_bytes` with least-recently-used files deleted first."""

    def __init__(self, root: str, namespace: str, max_bytes: int) -> None:
        self.dir = Path(root) / namespace
        self.max_bytes = max_bytes
        self.usable = True
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, oldest first
        self._warned: set[str] = set()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self.usable = False
            logger.error("HiCache storage: cannot use %s (%s); the storage tier is off, "
                         "prefixes not on device or host are recomputed", self.dir, e)  # fmt: skip

    def _scan(self) -> None:
        files = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".tmp"):
                _unlink(Path(entry.path))  # left by a crash mid-write: never loadable
            elif entry.name.endswith(".kv") and entry.is_file():
                stat = entry.stat()
                files.append((stat.st_mtime, entry.name[:-3], stat.st_size))
        for _, key, size in sorted(files):
            self._index[key] = size
        logger.info("HiCache storage: %s holds %d pages (%.1f MiB)", self.dir, len(files),
                    self.total_bytes / 2**20)  # fmt: skip

    @property
    def total_bytes(self) -> int:
        return sum(self._index.values())

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.kv"

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def get(self, key: str) -> bytes | None:
        try:
            blob = self._path(key).read_bytes()
        except OSError:
            with self._lock:
                self._index.pop(key, None)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return blob

    def set(self, key: str, blob: bytes) -> bool:
        if not self.usable or len(blob) > self.max_bytes:
            return False
        with self._lock:
            if key in self._index:
                return True
            self._make_room(len(blob))
        tmp = self.dir / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except OSError as e:
            _unlink(tmp)
            self._warn_once(f"write:{e.errno}", "HiCache storage: cannot write to %s (%s); "
                            "pages are not stored, serving continues", self.dir, e)  # fmt: skip
            return False
        with self._lock:
            self._index[key] = len(blob)
        return True

    def _make_room(self, size: int) -> None:
        total = self.total_bytes
        while self._index and total + size > self.max_bytes:
            key, old = self._index.popitem(last=False)
            _unlink(self._path(key))
            total -= old

    def discard(self, key: str) -> None:
        with self._lock:
            self._index.pop(key, None)
        _unlink(self._path(key))

    def clear(self) -> None:
        with self._lock:
            for key in list(self._index):
                _unlink(self._path(key))
            self._index.clear()

    def describe(self) -> dict:
        with self._lock:
            return {"hicache_storage_dir": str(self.dir), "hicache_storage_pages": len(self._index),
                    "hicache_storage_bytes": self.total_bytes}  # fmt: skip

    def _warn_once(self, kind: str, msg: str, *args) -> None:
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        logger.log(level, msg, *args)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def make_backend(name: str, extra: dict, namespace: str) -> StorageBackend:
    """`file` or `dynamic` (a class taking (extra_config, namespace), implementing the seam)."""
    if name == "file":
        root = extra.get("file_path") or os.environ.get(DIR_ENV) or DEFAULT_DIR
        max_gb = float(extra.get("max_size_gb", DEFAULT_MAX_SIZE_GB))
        return FileBackend(root, namespace, int(max_gb * 2**30))
    if name == "dynamic":
        module_path, class_name = extra.get("module_path"), extra.get("class_name")
        if not module_path or not class_name:
            raise ValueError("--hicache-storage-backend dynamic needs module_path and class_name "
                             "in --hicache-storage-backend-extra-config")  # fmt: skip
        cls = getattr(importlib.import_module(module_path), class_name)
        return cls(extra, namespace)
    raise ValueError(f"--hicache-storage-backend {name}: use file or dynamic")


class PageCodec:
    """Frames one page's tensors with the header that makes a foreign or damaged blob refusable."""

    def __init__(self, identity: str, kv_shape: tuple, index_shape: tuple, dtype: torch.dtype):
        self.identity = identity
        self.kv_shape, self.index_shape, self.dtype = kv_shape, index_shape, dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.kv_bytes = itemsize * _numel(kv_shape)
        self.payload_bytes = self.kv_bytes + itemsize * _numel(index_shape)

    def page_keys(self, tokens: list[int], page_size: int) -> list[str]:
        """Key of every whole page of `tokens`: a hash chain from the model identity."""
        keys, digest = [], bytes.fromhex(self.identity)
        ids = torch.tensor(tokens, dtype=torch.int64)
        for start in range(0, len(tokens) // page_size * page_size, page_size):
            digest = hashlib.sha256(digest + ids[start : start + page_size].numpy().tobytes())
            digest = digest.digest()
            keys.append(digest.hex())
        return keys

    def encode(self, key: str, page: PageTensors) -> bytes:
        payload = _raw(page.kv) + _raw(page.index)
        header = {"format": FORMAT_VERSION, "identity": self.identity, "key": key,
                  "kv_shape": list(self.kv_shape), "index_shape": list(self.index_shape),
                  "dtype": str(self.dtype), "payload_bytes": len(payload),
                  "sha256": hashlib.sha256(payload).hexdigest()}  # fmt: skip
        return MAGIC + json.dumps(header).encode() + b"\n" + payload

    def decode(self, key: str, blob: bytes) -> PageTensors | None:
        """The page in `blob`, or None (logged) if anything about it is wrong."""
        problem, header, payload = self._check(key, blob)
        if problem is not None:
            logger.warning("HiCache storage: skipped page %s: %s; it is recomputed (and the "
                           "file replaced)", key[:16], problem)  # fmt: skip
            return None
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        kv = raw[: self.kv_bytes].view(self.dtype).view(self.kv_shape)
        index = raw[self.kv_bytes :].view(self.dtype).view(self.index_shape)
        return PageTensors(kv, index)

    def _check(self, key: str, blob: bytes) -> tuple[str | None, dict, bytes]:
        if not blob.startswith(MAGIC):
            return "not a dsaserve KV page (bad magic)", {}, b""
        end = blob.find(b"\n", len(MAGIC))
        try:
            header = json.loads(blob[len(MAGIC) : end])
        except ValueError:
            return "unreadable header (corrupt or truncated)", {}, b""
        payload = blob[end + 1 :]
        if header.get("identity") != self.identity:
            return "written by another model/layout (foreign identity)", header, payload
        expected = {"format": FORMAT_VERSION, "key": key, "kv_shape": list(self.kv_shape),
                    "index_shape": list(self.index_shape), "dtype": str(self.dtype),
                    "payload_bytes": self.payload_bytes}  # fmt: skip
        for name, value in expected.items():
            if header.get(name) != value:
                return f"header {name} is {header.get(name)!r}, expected {value!r}", header, payload
        if len(payload) != self.payload_bytes:
            return f"truncated ({len(payload)} of {self.payload_bytes} payload bytes)", header, b""
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return "checksum mismatch (corrupt)", header, payload
        return None, header, payload


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class Prefetch:
    """Reads pages `keys[0..]` in order on a thread until one is missing or bad, or cancelled."""

    def __init__(self, tier: StorageTier, keys: list[str]) -> None:
        self.keys = keys
        self.pages: list[PageTensors] = []
        self.done = threading.Event()
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(tier,), daemon=True)
        self._thread.start()

    def _run(self, tier: StorageTier) -> None:
        try:
            for key in self.keys:
                if self._cancel.is_set():
                    break
                page = tier.read(key)
                if page is None:
                    break
                self.pages.append(page)
        finally:
            self.done.set()

    def cancel(self) -> list[PageTensors]:
        """Stop reading; the pages read so far."""
        self._cancel.set()
        return list(self.pages)


class StorageTier:
    """The codec over a backend, with a background writer; counters for reporting."""

    def __init__(self, backend: StorageBackend, codec: PageCodec) -> None:
        self.backend, self.codec = backend, codec
        self.counters = {"hicache_storage_write_pages": 0, "hicache_storage_write_bytes": 0,
                         "hicache_storage_read_pages": 0, "hicache_storage_read_bytes": 0,
                         "hicache_storage_rejected_pages": 0}  # fmt: skip
        self._writes: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._writer.start()
        atexit.register(self._drain_at_exit)

    def exists(self, key: str) -> bool:
        return self.backend.exists(key)

    def write_async(self, key: str, page: PageTensors) -> None:
        """Queue a page (its tensors must not change afterwards: pass copies)."""
        self._writes.put((key, page))

    def _write_loop(self) -> None:
        while True:
            key, page = self._writes.get()
            try:
                if not self.backend.exists(key):
                    blob = self.codec.encode(key, page)
                    if self.backend.set(key, blob):
                        self.counters["hicache_storage_write_pages"] += 1
                        self.counters["hicache_storage_write_bytes"] += len(blob)
            except Exception:  # a backend bug must not kill the writer
                logger.exception("HiCache storage: writing page %s failed", key[:16])
            finally:
                self._writes.task_done()

    def drain(self) -> None:
        """Block until every queued write is done (tests, benchmarks, shutdown)."""
        self._writes.join()

    def _drain_at_exit(self, timeout: float = EXIT_DRAIN_S) -> None:
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def finish(self) -> None:
        """Before a process ends without atexit (a rank's os._exit): let the queued writes
        land, up to EXIT_DRAIN_S."""
        self._drain_at_exit()

    def read(self, key: str) -> PageTensors | None:
        try:
            blob = self.backend.get(key)
        except Exception:
            logger.exception("HiCache storage: reading page %s failed", key[:16])
            return None
        if blob is None:
            return None
        page = self.codec.decode(key, blob)
        if page is None:
            self.counters["hicache_storage_rejected_pages"] += 1
            self.backend.discard(key)
            return None
        self.counters["hicache_storage_read_pages"] += 1
        self.counters["hicache_storage_read_bytes"] += len(blob)
        return page

    def prefetch(self, keys: list[str]) -> Prefetch:
        return Prefetch(self, keys)

    def stats(self) -> dict:
        return {**self.counters, **self.backend.describe()}


def model_identity(model_path: str, parts: dict) -> str:
    """SHA-256 of what produced the KV: the checkpoint's config and weight-file fingerprints
    (name, size, first and last MiB of each), plus `parts` (dtype, KV dtype, page size, layers,
    tp layout). Two checkpoints differing anywhere that matters get different identities."""
    h = hashlib.sha256(json.dumps(parts, sort_keys=True).encode())
    folder = Path(model_path)
    for name in ("config.json",):
        if (folder / name).is_file():
            h.update((folder / name).read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(size - (1 << 20), 0))
            h.update(f.read(1 << 20))
    return h.hexdigest()
