"""The checkpoint a flag names: a folder on this machine, or a Hugging Face Hub id.

`--model-path`, `--tokenizer-path` and `--speculative-draft-model-path` take either, as SGLang's
do. An id (`org/name`, not a folder here) is resolved once, in the launching process before any
rank starts, through `huggingface_hub.snapshot_download`: the local cache first (no request),
else a download of only the files a server reads, with progress, into the cache
(`--download-dir`, else `HF_HUB_CACHE` / `$HF_HOME/hub`). The Hub's own environment applies
(`HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE`). Every rank, replica and engine process is given
the resolved snapshot folder, so they all read the commit resolved here (one download per node:
each node's launching process resolves into its own cache). The id the user gave stays in
`ServerArgs.model_id` for `/v1/models` and `/get_model_info`.

Two starts sharing a cache download an id once: the second waits on the first's lock, saying
whose download (its pid) it waits for, and then finds the snapshot in the cache; a wait on
huggingface_hub's own per-file lock (another program downloading into the same cache) is said too.

A failure (not cached and offline, unreachable, 401, 404, no such revision) is one `ArgsError`
naming the flag and the id: `dsaserve serve` exits 2.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from dsaserve import process_tree
from dsaserve.args import ArgsError, ServerArgs

# What a server reads: config, tokenizer, chat template, generation config, weights and index
TOKENIZER_FILES = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
CHECKPOINT_FILES = [*TOKENIZER_FILES, "*.safetensors"]
REMOTE_CODE = ["*.py"]  # only with --trust-remote-code
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")

WAIT_SAY_EVERY_S = 10.0  # a wait on another process's download is said at once, then this often
WAIT_POLL_S = 0.2
HF_LOCK_LOGGER = "huggingface_hub.utils._fixes"  # WeakFileLock's "Still waiting ..." lines
HF_LOCK_WAIT = re.compile(r"Still waiting to acquire lock on (.+) \(elapsed: ([\d.]+) seconds\)")

Say = Callable[[str], None]


def is_repo_id(path: str) -> bool:
    """Whether `path` names a Hub repo: no such file here, and shaped `org/name` (or `name`)."""
    if os.path.exists(path) or path.startswith(("/", ".", "~")):
        return False
    return REPO_ID.fullmatch(path) is not None


def resolve_checkpoints(args: ServerArgs, say: Say) -> ServerArgs:
    """`args` with every Hub id among the checkpoint flags replaced by its local snapshot
    folder (ArgsError when one cannot be had); `say` is told each phase as it begins."""
    changes: dict[str, str] = {}
    model = args.model_path
    if is_repo_id(model):
        files = CHECKPOINT_FILES + (REMOTE_CODE if args.trust_remote_code else [])
        changes["model_path"] = snapshot("--model-path", model, args.revision, args, files, say)
        changes["model_id"] = model
    tokenizer = args.tokenizer_path
    if tokenizer and is_repo_id(tokenizer):
        revision = args.revision if tokenizer == model else None
        changes["tokenizer_path"] = snapshot(
            "--tokenizer-path", tokenizer, revision, args, TOKENIZER_FILES, say
        )
    drafter = args.speculative_draft_model_path
    if drafter and is_repo_id(drafter):
        changes["speculative_draft_model_path"] = snapshot(
            "--speculative-draft-model-path", drafter, None, args, CHECKPOINT_FILES, say
        )
    return args.replace(**changes) if changes else args


def snapshot(
    flag: str, repo_id: str, revision: str | None, args: ServerArgs, files: list[str], say: Say
) -> str:
    """The local snapshot folder of `repo_id` at `revision`: from the cache, else downloaded."""
    at = f" (revision {revision})" if revision else ""
    say(f"resolving {flag} {repo_id}{at} through the Hugging Face cache {cache_dir(args)}")
    common = {"revision": revision, "cache_dir": args.download_dir, "allow_patterns": files}
    folder = _cached(repo_id, common, files)
    if folder is None and constants.HF_HUB_OFFLINE:
        raise ArgsError(f"{flag} {repo_id}: not a folder on this machine and not in the Hugging "
                        f"Face cache {cache_dir(args)}, and HF_HUB_OFFLINE is set: run once "
                        "online, or give a checkpoint folder")  # fmt: skip
    if folder is None:
        with download_lock(Path(cache_dir(args)), repo_id, say):  # one download per cache
            folder = _cached(repo_id, common, files)  # another start's download, finished
            if folder is None:
                return _download(flag, repo_id, common, say)
    say(f"{repo_id}: found in the cache: {folder}")
    return folder


def _cached(repo_id: str, common: dict, files: list[str]) -> str | None:
    """The complete cached snapshot, asking nothing of the Hub; None when it is not there."""
    try:
        folder = snapshot_download(repo_id, local_files_only=True, **common)
    except (LocalEntryNotFoundError, HFValidationError):
        return None  # not (fully) cached: the Hub is asked, and names a bad id
    return folder if _complete(folder, files) else None


@contextlib.contextmanager
def download_lock(cache: Path, repo_id: str, say: Say) -> Iterator[None]:
    """This process's turn to download `repo_id` into `cache`: another dsaserve start downloading
    it holds the lock (an flock on a file naming its pid), and this one says whose download it
    waits for, at once and then every WAIT_SAY_EVERY_S, then reads what it left in the cache."""
    locks = cache / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    path = locks / f"dsaserve--{repo_id.replace('/', '--')}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
    try:
        start, said = time.monotonic(), -WAIT_SAY_EVERY_S
        while not _try_flock(fd):
            if time.monotonic() - said >= WAIT_SAY_EVERY_S:
                said = time.monotonic()
                owner = os.pread(fd, 32, 0).decode().strip() or "unknown"
                say(f"waiting for another process's download of {repo_id} (pid {owner}, lock "
                    f"{path}); waited {said - start:.0f} s")  # fmt: skip
            time.sleep(WAIT_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing releases the flock


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _download(flag: str, repo_id: str, common: dict, say: Say) -> str:
    endpoint = constants.ENDPOINT
    say(f"downloading {repo_id} from {endpoint} (progress below)")
    start = time.monotonic()
    try:
        with _said_lock_waits(repo_id, say):
            folder = snapshot_download(repo_id, **common)
    except Exception as e:  # whatever the Hub answered ends the start, in one line
        why = _why(e, endpoint)
        raise ArgsError(f"{flag} {repo_id}: not a folder on this machine, and {why}") from None
    size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
    say(f"{repo_id}: downloaded {size} bytes in {time.monotonic() - start:.1f} s: {folder}")
    return folder


@contextlib.contextmanager
def _said_lock_waits(repo_id: str, say: Say) -> Iterator[None]:
    """huggingface_hub's own waits on a file's lock (another program downloading the same blob
    into this cache; it logs one every 10 s at INFO, which its default level hides), said as a
    phase with the pids holding that lock."""
    log = logging.getLogger(HF_LOCK_LOGGER)
    handler = _LockWaits(repo_id, say)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


class _LockWaits(logging.Handler):
    def __init__(self, repo_id: str, say: Say) -> None:
        super().__init__(logging.INFO)
        self.repo_id = repo_id
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        waiting = HF_LOCK_WAIT.match(record.getMessage())
        if waiting is None:
            return
        lock, elapsed = waiting.groups()
        others = [pid for pid in process_tree.holding(Path(lock)) if pid != os.getpid()]
        whose = f"pid {', '.join(map(str, others))}" if others else "a process"
        self.say(f"waiting for another process's download of a file of {self.repo_id} "
                 f"({whose} holds {lock}); waited {elapsed} s")  # fmt: skip


def _complete(folder: str, files: list[str]) -> bool:
    """A cached snapshot holds at least the config (and the weights, when they are asked for);
    a folder filled by a tokenizer-only download is not a checkpoint."""
    path = Path(folder)
    if not (path / "config.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return False
    return "*.safetensors" not in files or any(path.glob("*.safetensors"))


def _why(error: Exception, endpoint: str) -> str:
    """What went wrong asking the Hub, in a clause."""
    if isinstance(error, GatedRepoError):
        return f"it is gated on {endpoint}: accept its terms there and set HF_TOKEN"
    if isinstance(error, RepositoryNotFoundError):
        return (f"{endpoint} has no such model, or it needs a token (401/404): check the id, or "
                "set HF_TOKEN")  # fmt: skip
    if isinstance(error, RevisionNotFoundError):
        return f"{endpoint} has no such revision of it (--revision)"
    if isinstance(error, HFValidationError):
        return "it is not a valid Hub id (org/name)"
    if isinstance(error, LocalEntryNotFoundError):
        return f"it is not in the cache and {endpoint} cannot be reached"
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"asking {endpoint} failed: {type(error).__name__}: {first}"


def cache_dir(args: ServerArgs) -> str:
    return args.download_dir or constants.HF_HUB_CACHE
