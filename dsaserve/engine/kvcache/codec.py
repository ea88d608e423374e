"""How HiCache frames one page for storage, and the per-deployment key that authenticates it.

A blob is `MAGIC`, the HMAC-SHA256 (hex) of everything after its line, a JSON header (format,
model identity, key, tensor shapes, dtype, payload size) and the payload: the page's MLA entry in
every layer (the MTP layer included) and its indexer key in every indexer layer. The MAC is
checked before the header is parsed, so a blob that was not written with this deployment's key
(damaged, truncated, foreign, or rewritten by someone with a fresh checksum) is refused as a
whole, whatever its header says.

The key: derived from the cluster secret when one is set (so every server of a deployment that
shares a storage directory or a `dynamic` backend shares it), else 32 random bytes kept in
`<storage dir>/hicache.key` (0600), made at first use and kept across restarts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from pathlib import Path
from typing import NamedTuple

import torch

from dsaserve.cluster.secret import derive

logger = logging.getLogger("dsaserve.engine.kvcache.storage")
MAGIC = b"DSAKV2\n"
FORMAT_VERSION = 2
KEY_FILE = "hicache.key"
MAC_HEX = 64


class PageTensors(NamedTuple):
    kv: torch.Tensor  # [layers, page_size, kv_entry_dim]: latent || rope, MTP layer last
    index: torch.Tensor  # [index_layers, page_size, index_head_dim]


def storage_key(secret: str | None, root: Path) -> bytes:
    """The key pages are authenticated with (see the module docstring)."""
    if secret:
        return derive(secret, "hicache/pages")
    path = root / KEY_FILE
    if not path.exists():
        _publish_key(path)
    key = path.read_bytes()
    if len(key) != 32:
        raise OSError(f"{path} is not a HiCache key (remove it to make a new one)")
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return key


def _publish_key(path: Path) -> None:
    """A new key file, whole or not at all: written aside and linked into place, so ranks that
    start together (--tp N, each its own tier) read one key, never a half-written file."""
    aside = path.with_name(f".{KEY_FILE}.{os.getpid()}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    try:
        os.link(aside, path)
    except FileExistsError:  # another rank's came first
        pass
    finally:
        os.unlink(aside)


class PageCodec:
    """Frames one page's tensors with the MAC and header that make a foreign, damaged or forged
    blob refusable."""

    def __init__(self, identity: str, kv_shape: tuple, index_shape: tuple, dtype: torch.dtype,
                 key: bytes) -> None:  # fmt: skip
        self.identity, self.key = identity, key
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
                  "dtype": str(self.dtype), "payload_bytes": len(payload)}  # fmt: skip
        body = json.dumps(header).encode() + b"\n" + payload
        return MAGIC + self._mac(body).encode() + b"\n" + body

    def _mac(self, body: bytes) -> str:
        return hmac.new(self.key, body, hashlib.sha256).hexdigest()

    def decode(self, key: str, blob: bytes) -> PageTensors | None:
        """The page in `blob`, or None (logged) if anything about it is wrong."""
        try:
            problem, payload = self._check(key, blob)
        except Exception as e:  # any shape of bad header is a rejected page, never a crash
            problem, payload = f"unreadable header ({type(e).__name__})", b""
        if problem is not None:
            logger.warning("HiCache storage: skipped page %s: %s; it is recomputed (and the "
                           "file replaced)", key[:16], problem)  # fmt: skip
            return None
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        kv = raw[: self.kv_bytes].view(self.dtype).view(self.kv_shape)
        index = raw[self.kv_bytes :].view(self.dtype).view(self.index_shape)
        return PageTensors(kv, index)

    def _check(self, key: str, blob: bytes) -> tuple[str | None, bytes]:
        if not blob.startswith(MAGIC):
            return "not a dsaserve KV page of this format (bad magic)", b""
        start = len(MAGIC) + MAC_HEX + 1
        end = blob.find(b"\n", start)
        if end < 0 or blob[start - 1 : start] != b"\n":
            return "unreadable header (corrupt or truncated)", b""
        payload = blob[end + 1 :]
        if len(payload) != self.payload_bytes:
            return f"truncated ({len(payload)} of {self.payload_bytes} payload bytes)", b""
        mac = blob[len(MAGIC) : start - 1].decode("ascii", "replace")
        if not hmac.compare_digest(mac, self._mac(blob[start:])):
            return "not authenticated by this deployment's key (corrupt or forged)", b""
        header = json.loads(blob[start:end])
        if not isinstance(header, dict):
            return "the header is not a JSON object", b""
        if header.get("identity") != self.identity:
            return "written by another model/layout (foreign identity)", b""
        expected = {"format": FORMAT_VERSION, "key": key, "kv_shape": list(self.kv_shape),
                    "index_shape": list(self.index_shape), "dtype": str(self.dtype),
                    "payload_bytes": self.payload_bytes}  # fmt: skip
        for name, value in expected.items():
            if header.get(name) != value:
                return f"header {name} is {header.get(name)!r}, expected {value!r}", b""
        return None, payload


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()
