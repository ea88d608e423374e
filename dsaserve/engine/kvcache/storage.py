"""HiCache's storage tier (L3): KV pages in files that outlive the server.

A page is stored as one framed blob (codec.py: authenticated by the deployment's HMAC key,
then a JSON header and the payload). A page's key chains the SHA-256 of the model identity and
every token up to the page's end, so a key names one prefix of one model. A blob that fails any
check (not authenticated, truncated, foreign identity, a header of any wrong shape) is logged,
counted as rejected, removed, and its tokens recomputed; never loaded.

Seam: `StorageBackend` stores opaque blobs by key (`exists`, `get`, `set`, `clear`). `file` is a
directory backend (atomic tmp + rename writes, a size cap with LRU eviction); `dynamic` loads a
user class named in `--hicache-storage-backend-extra-config` (`module_path`, `class_name`).
`StorageTier` frames pages and runs writes and prefetches on background threads. The `file`
backend's directory is 0700 and its files 0600; by default it lives under the user's cache
directory (`$XDG_CACHE_HOME/dsaserve/hicache`, else `~/.cache/dsaserve/hicache`).
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

from dsaserve.engine.kvcache.codec import PageCodec, PageTensors

logger = logging.getLogger(__name__)

DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # SGLang's variable for the file backend
DEFAULT_MAX_SIZE_GB = 10.0
EXIT_DRAIN_S = 10.0  # how long a normal exit waits for queued writes (then they are dropped)


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
            private_dir(Path(root))
            private_dir(self.dir)
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
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
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


def default_dir() -> Path:
    """Under the user's cache directory (not a shared /tmp, which SGLang's file backend uses)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "dsaserve" / "hicache"


def storage_root(extra: dict) -> Path:
    """`file_path` from the extra config, else SGLang's variable, else `default_dir()`."""
    return Path(extra.get("file_path") or os.environ.get(DIR_ENV) or default_dir())


def private_dir(path: Path) -> None:
    """Create `path` (and missing parents) 0700; a folder of ours that exists is made 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_mode & 0o077 and info.st_uid == os.getuid():
        os.chmod(path, 0o700)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def make_backend(name: str, extra: dict, namespace: str) -> StorageBackend:
    """`file` or `dynamic` (a class taking (extra_config, namespace), implementing the seam)."""
    if name == "file":
        max_gb = float(extra.get("max_size_gb", DEFAULT_MAX_SIZE_GB))
        return FileBackend(str(storage_root(extra)), namespace, int(max_gb * 2**30))
    if name == "dynamic":
        module_path, class_name = extra.get("module_path"), extra.get("class_name")
        if not module_path or not class_name:
            raise ValueError("--hicache-storage-backend dynamic needs module_path and class_name "
                             "in --hicache-storage-backend-extra-config")  # fmt: skip
        cls = getattr(importlib.import_module(module_path), class_name)
        return cls(extra, namespace)
    raise ValueError(f"--hicache-storage-backend {name}: use file or dynamic")


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
