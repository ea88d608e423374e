"""Checkpoints named as users name them: Hugging Face Hub ids, resolved through a Hub stand-in on
loopback (tests/hub_standin.py) with `HF_ENDPOINT` pointed at it and an empty `HF_HOME`.

`dsaserve serve --model-path zai-org/GLM-5.3` downloads only what a server reads, serves it and
reports the id; a second start, offline and with the stand-in gone, serves the same snapshot from
the cache; `--revision`, `--download-dir`, `--tokenizer-path` and
`--speculative-draft-model-path` resolve the same way; an id that is neither cached nor reachable
(unknown, private without a token, offline, no Hub) is one error line and exit 2.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from deepseek_checkpoint import make_deepseek_server_checkpoint
from filelock import FileLock
from hub_standin import TOKEN, hub_env, running_hub
from server_harness import (
    HANG_GUARD_S,
    START_TIMEOUT_S,
    Server,
    rendezvous_address,
    running_command,
    stop_group,
    wait_for,
)

from dsaserve.runtime.hub import is_repo_id

GLM, DEEPSEEK = "zai-org/GLM-5.3", "deepseek-ai/DeepSeek-V3.2"
UNNEEDED = ("README.md", "original/consolidated.bin")  # in the repo, never read by a server


@pytest.fixture(scope="module")
def repos(server_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub_repos")
    glm = Path(shutil.copytree(server_checkpoint, root / "glm"))
    (glm / "original").mkdir()
    (glm / "original" / "consolidated.bin").write_bytes(b"\0" * 4096)
    (glm / "README.md").write_text("a model card\n")
    return {GLM: glm, DEEPSEEK: make_deepseek_server_checkpoint(root / "deepseek")}


def serve_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "dsaserve.cli", "serve", *flags, "--port", "0",
            "--max-total-tokens", "4096", "--page-size", "16"]  # fmt: skip


def server_env(env: dict) -> dict:
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def chat(base: str) -> str:
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=HANG_GUARD_S)
    assert [m.id for m in client.models.list().data] == [GLM]
    reply = client.chat.completions.create(
        model=GLM, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0
    )
    assert reply.model == GLM and reply.usage.completion_tokens > 0
    return reply.choices[0].message.content or ""


def test_repo_ids_and_folders() -> None:
    assert is_repo_id(GLM) and is_repo_id("gpt2") and is_repo_id("org/name-1.5_b")
    assert not is_repo_id(str(Path(__file__).parent))  # a folder here
    for path in ("/models/GLM-5.3", "./GLM-5.3", "~/GLM", "a/b/c", "org/", "bad id"):
        assert not is_repo_id(path), path


def test_serve_a_hub_id_then_offline_from_the_cache(repos: dict, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    with running_hub(repos) as hub:
        env = server_env(hub_env(os.environ, hub.url, home))
        with running_command(serve_command("--model-path", GLM), env) as server:
            first = chat(server.base)
            info = httpx.get(server.url + "/get_model_info", timeout=HANG_GUARD_S).json()
            server_info = httpx.get(server.url + "/get_server_info", timeout=HANG_GUARD_S).json()
            served_from = server_info["model_path"]
        fetched = hub.fetched()
    assert info["model_path"] == GLM and info["served_model_name"] == GLM
    snapshot = home / "hub" / "models--zai-org--GLM-5.3" / "snapshots" / hub.sha[GLM]
    assert Path(served_from) == snapshot  # every process read the resolved snapshot
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            "generation_config.json"} <= fetched  # fmt: skip
    assert not fetched & set(UNNEEDED)
    phases = [f"resolving --model-path {GLM}", f"downloading {GLM} from {hub.url}",
              f"{GLM}: downloaded", "dsaserve serve: memory: ", f"loading weights from {snapshot}",
              f"loaded weights from {snapshot}", "dsaserve ready: "]  # fmt: skip
    log = server.output()
    at = [log.find(phase) for phase in phases]
    assert -1 not in at and at == sorted(at), log  # each phase named, in order
    assert re.search(r"bytes on disk\): \d+ bytes held, in \d+\.\d s", log), log
    offline = server_env(hub_env(os.environ, hub.url, home, offline=True))  # the stand-in is gone
    with running_command(serve_command("--model-path", GLM), offline) as again:
        assert chat(again.base) == first
    assert f"{GLM}: found in the cache: {snapshot}" in again.output()


RESOLVE = """
import json, sys
from dsaserve.args import ServerArgs
from dsaserve.runtime.hub import resolve_checkpoints
say = lambda line: print(line, file=sys.stderr, flush=True)
args = resolve_checkpoints(ServerArgs.from_cli(sys.argv[1:]), say)
print(json.dumps([args.model_path, args.model_id, args.tokenizer_path,
                  args.speculative_draft_model_path]))
"""


def test_revision_download_dir_tokenizer_and_drafter_ids(repos: dict, tmp_path: Path) -> None:
    home, cache = tmp_path / "hf", tmp_path / "downloads"
    with running_hub(repos) as hub:
        flags = ["--model-path", DEEPSEEK, "--revision", hub.sha[DEEPSEEK],
                 "--download-dir", str(cache), "--tokenizer-path", GLM,
                 "--speculative-draft-model-path", GLM]  # fmt: skip
        run = subprocess.run([sys.executable, "-c", RESOLVE, *flags], capture_output=True,
                             text=True, env=hub_env(os.environ, hub.url, home),
                             timeout=START_TIMEOUT_S)  # fmt: skip  # hang guard
        assert run.returncode == 0, run.stderr
    model, model_id, tokenizer, drafter = json.loads(run.stdout)
    assert Path(model) == cache / "models--deepseek-ai--DeepSeek-V3.2/snapshots" / hub.sha[DEEPSEEK]
    assert model_id == DEEPSEEK
    assert json.loads((Path(model) / "config.json").read_text())["model_type"] == "deepseek_v32"
    assert Path(tokenizer).parent.parent.name == "models--zai-org--GLM-5.3"
    assert (Path(tokenizer) / "tokenizer.json").is_file()
    assert (Path(drafter) / "model.safetensors").is_file()  # tokenizer files alone did not do
    assert not (home / "hub").exists()  # --download-dir, not HF_HOME


def test_unresolvable_ids_exit_2_with_one_line(repos: dict, tmp_path: Path) -> None:
    with running_hub(repos, private=(DEEPSEEK,)) as hub:
        online = hub_env(os.environ, hub.url, tmp_path / "hf")
        cases = [
            ("zai-org/No-Such-Model", online, "has no such model"),
            (DEEPSEEK, online, "needs a token (401/404)"),  # private, no HF_TOKEN
            (GLM, hub_env(os.environ, hub.url, tmp_path / "hf", offline=True), "HF_HUB_OFFLINE"),
        ]
        for model, env, reason in cases:
            expect_refusal(model, env, reason)
        with_token = {**online, "HF_TOKEN": TOKEN}
        run = subprocess.run([sys.executable, "-c", RESOLVE, "--model-path", DEEPSEEK],
                             capture_output=True, text=True, env=with_token,
                             timeout=START_TIMEOUT_S)  # fmt: skip  # hang guard
        assert run.returncode == 0, run.stderr  # the token opens it
    expect_refusal(GLM, online, "cannot be reached")  # the stand-in's port is closed now


def expect_refusal(model: str, env: dict, reason: str) -> None:
    run = subprocess.run(serve_command("--model-path", model), capture_output=True, text=True,
                         env=env, timeout=START_TIMEOUT_S)  # fmt: skip  # hang guard
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert run.returncode == 2, run.stderr
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    assert errors[0].startswith(f"dsaserve serve: error: --model-path {model}: "), errors
    assert reason in errors[0], errors


@contextlib.contextmanager
def started(command: list[str], env: dict) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """`command` in its own process group, its stderr lines collected as they come; the group
    is stopped when the block exits, even on failure."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, start_new_session=True)  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        for line in process.stderr:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield process, lines
        process.wait(HANG_GUARD_S)  # hang guard
        reader.join(HANG_GUARD_S)  # hang guard
    finally:
        stop_group(process)


def test_two_starts_download_once_the_second_says_whose_it_waits_for(
    repos: dict, tmp_path: Path
) -> None:
    resolve = [sys.executable, "-c", RESOLVE, "--model-path", GLM]
    with running_hub(repos) as hub:
        hub.gates["model.safetensors"] = gate = threading.Event()  # the first download hangs
        weights = ("GET", f"/{GLM}/resolve/{hub.sha[GLM]}/model.safetensors")
        held = {"HF_HUB_DOWNLOAD_TIMEOUT": str(int(HANG_GUARD_S))}  # the held GET is not retried
        env = {**hub_env(os.environ, hub.url, tmp_path / "hf"), **held}
        with started(resolve, env) as (first, _):
            wait_for(lambda: weights in hub.requests, "the first start's weights in flight")
            with started(resolve, env) as (second, said):
                waiting = wait_for(lambda: [x for x in said if "waiting for another" in x],
                                   "the second start says it waits")  # fmt: skip
                gate.set()
        assert (first.returncode, second.returncode) == (0, 0), "".join(said)
        assert hub.requests.count(weights) == 1  # one download for both
    assert f"download of {GLM} (pid {first.pid}, lock " in waiting[0], waiting
    assert json.loads(first.stdout.read())[0] == json.loads(second.stdout.read())[0]
    assert f"{GLM}: found in the cache" in "".join(said)


LLM_SCRIPT = """
import sys
from dsaserve import LLM, SamplingParams
with LLM(sys.argv[1], max_total_tokens=256, page_size=16) as llm:
    out = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    print(len(out[0].token_ids))
"""


def test_the_offline_llm_takes_a_hub_id(repos: dict, tmp_path: Path) -> None:
    with running_hub(repos) as hub:
        env = server_env(hub_env(os.environ, hub.url, tmp_path / "hf"))
        run = subprocess.run([sys.executable, "-c", LLM_SCRIPT, GLM], capture_output=True,
                             text=True, env=env, timeout=START_TIMEOUT_S)  # fmt: skip  # hang guard
    assert run.returncode == 0 and run.stdout.split()[-1] == "2", run.stderr
    assert f"dsaserve: {GLM}: downloaded" in run.stderr


def test_a_wait_on_another_programs_file_lock_names_its_pid(repos: dict, tmp_path: Path) -> None:
    """huggingface_hub's own per-file lock, held by another program downloading the same blob
    (here this test): the start says whose lock it waits on (huggingface_hub notes the wait every
    10 s), and goes on once it is released."""
    home = tmp_path / "hf"
    weights = (repos[GLM] / "model.safetensors").read_bytes()
    etag = hashlib.sha256(weights).hexdigest()  # the stand-in's ETag names the blob and its lock
    lock = home / "hub" / ".locks" / "models--zai-org--GLM-5.3" / f"{etag}.lock"
    lock.parent.mkdir(parents=True)
    held = FileLock(lock)
    held.acquire()
    try:
        with running_hub(repos) as hub:
            resolve = [sys.executable, "-c", RESOLVE, "--model-path", GLM]
            with started(resolve, hub_env(os.environ, hub.url, home)) as (run, said):
                waiting = wait_for(lambda: [x for x in said if " holds " in x],
                                   "the start says whose lock it waits on")  # fmt: skip
                held.release()
        assert run.returncode == 0, "".join(said)
    finally:
        held.release()
    assert f"(pid {os.getpid()} holds {lock})" in waiting[0], waiting


def test_two_nodes_each_resolve_the_id_into_their_own_cache(repos: dict, tmp_path: Path) -> None:
    """The planner's two-node command, as printed but for the address: node 1 runs its own
    command with its own HF_HOME, resolves the id itself into that cache (one download per
    node), and the two nodes' ranks serve it together. Node 0 takes `--dist-init-addr
    127.0.0.1:0` and prints the port it holds; node 1 is given that."""
    nodes = ["--model-path", GLM, "--tp", "2", "--nnodes", "2"]
    node1: list[subprocess.Popen] = []
    with running_hub(repos) as hub:
        env0, env1 = (server_env(hub_env(os.environ, hub.url, tmp_path / n)) for n in "ab")

        def start_node1(node0: Server) -> None:
            where = rendezvous_address(node0)
            command = serve_command(*nodes, "--node-rank", "1", "--dist-init-addr", where)
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            node1.append(subprocess.Popen(command, env=env1, start_new_session=True, **quiet))

        node0 = serve_command(*nodes, "--node-rank", "0", "--dist-init-addr", "127.0.0.1:0")
        try:
            with running_command(node0, env0, start_node1) as server:
                chat(server.base)
        finally:
            for process in node1:
                stop_group(process)
        weights = [p for m, p in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    assert len(weights) == 2, hub.requests  # one download per node
    for home in ("a", "b"):
        snapshot = tmp_path / home / "hub" / "models--zai-org--GLM-5.3" / "snapshots" / hub.sha[GLM]
        assert (snapshot / "model.safetensors").is_file()
