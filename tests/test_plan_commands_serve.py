"""Every `dsaserve serve` command `dsaserve plan` prints whose layout this machine can host
(tp, dp and ep <= 4, any flags) passes `dsaserve serve`'s start-up checks (none is refused), and
one per layout starts, as printed, and answers requests.

The commands come from the planner itself, over every hardware and built-in model, each recipe
and the options that change the printed flags (speculative, KV dtype, HiCache, PD role), plus
the CPU plan of a tiny checkpoint folder (a random GLM with an MTP layer, heads and experts
divisible by 4). Their Hub ids (`--model-path zai-org/GLM-5.3`, the DFLASH drafter
`incoai/GLM-5.3-DFlash2`, ...) are not rewritten: a Hub stand-in on loopback
(tests/hub_standin.py) serves that checkpoint under every built-in model's id and a random
published-format DFlash2 drafter under the drafter's, and `dsaserve serve` resolves them itself
(the start checks resolve them the same way, offline, from a cache filled from the stand-in).
Only `--host` and `--port` are left to the harness (an OS-chosen port; it also sets a 4096-token
KV pool, which is what `--mem-fraction-static`, a GPU's share, would size). Three are started,
sent three requests at once with the openai SDK and stopped, their process trees empty
afterwards: the CPU plan's (one rank); the one four-rank layout that composes every other
(`--tp 4 --dp 4 --ep 4` under DP attention with DeepEP, EAGLE and HiCache: four ranks on two
cores are started once per run); and the DFLASH layout at two ranks (`--tp 4` halved: its
drafter under tensor parallelism). The started Hub ids are downloaded once between them (the
later start and every rank read the snapshot the first left in the cache). The other layouts'
pieces run in that composition and at two ranks in tests/test_parallel_serve.py. PD-role
commands (`--disaggregation-mode`) run at tp N and under DP attention, and a prefill or decode
answers requests only behind the router with its partner: tests/test_pd_router.py starts those.
"""

from __future__ import annotations

import itertools
import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from dflash_models import write_drafter
from hub_standin import running_hub
from huggingface_hub import constants, snapshot_download
from server_harness import group_members, make_server_checkpoint, running_server
from speculative_models import add_mtp_layer

from dsaserve.args import ArgsError, ServerArgs, speculative_settings
from dsaserve.deploy.hardware import HARDWARE
from dsaserve.deploy.layout import PlanRequest, Refusal
from dsaserve.deploy.models import BUILTIN_MODELS
from dsaserve.deploy.planner import plan
from dsaserve.runtime.hub import CHECKPOINT_FILES, resolve_checkpoints
from dsaserve.runtime.preflight import check_layout, check_speculative_model, checkpoint_config

HOSTABLE = 4  # ranks this machine runs (two cores; tests run up to 4 ranks)
OPTIONS = {
    "recipe": ("low-latency", "balanced", "high-throughput"),
    "speculative": ("auto", "none", "dflash2"),
    "kv_cache_dtype": ("auto", "bf16"),
    "hicache": (False, True),
    "pd": (None, "prefill", "decode"),
}
REWRITTEN = ("--host", "--port")
PROMPTS = ["one two three four five six seven eight nine ten eleven twelve", "Hello", "a b c"]
# Started (see the docstring): the CPU plan, the four-rank composition, DFLASH halved to two ranks
STARTED = {"tp1 dp1 ep1 dpa0 plain": {}, "tp4 dp4 ep4 dpa1 eagle": {},
           "tp4 dp1 ep1 dpa0 dflash": {"--tp": "2"}}  # fmt: skip


def planned(pairs: list[tuple[str, str]], **fixed) -> list[tuple[str, list[str]]]:
    """(layout key, argv after `dsaserve serve`) of every printed serve command that fits."""
    out = []
    for hardware, model in pairs:
        for values in itertools.product(*OPTIONS.values()):
            options = dict(zip(OPTIONS, values), **fixed)
            try:
                p = plan(PlanRequest(model=model, hardware=hardware, **options))
            except Refusal:
                continue
            lay = p.layout
            if max(lay.tp, lay.dp, lay.ep) > HOSTABLE:
                continue
            for command in p.commands:
                if command.role != "router":
                    key = f"tp{lay.tp} dp{lay.dp} ep{lay.ep} dpa{int(lay.dp_attention)}"
                    spec = lay.speculative
                    key += (
                        f" {'dflash' if spec.algorithm == 'DFLASH' else 'eagle'}"
                        if spec
                        else " plain"
                    )
                    key += f" {command.role}" if command.role != "serve" else ""
                    out.append((key, shlex.split(command.dsaserve)[2:]))
    return out


def rewrite(argv: list[str]) -> list[str]:
    """The command's flags for this machine: host and port left to the harness."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in REWRITTEN:
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def start_check(flags: list[str]) -> str | None:
    """What `dsaserve serve` refuses before starting anything (None: it starts); its Hub ids
    resolved as the server resolves them (here from the cache the test filled)."""
    try:
        args = resolve_checkpoints(ServerArgs.from_cli(flags), lambda line: None)
        check_layout(args)
        speculative_settings(args)
        check_speculative_model(args, checkpoint_config(args))  # DFLASH: the drafter fits
    except ArgsError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = make_server_checkpoint(tmp_path_factory.mktemp("plan_serve") / "glm")
    return add_mtp_layer(folder, seed=1)


@pytest.fixture(scope="module")
def drafter(checkpoint, tmp_path_factory):
    return str(write_drafter(tmp_path_factory.mktemp("plan_serve") / "dflash2", checkpoint,
                             block_size=8))  # fmt: skip


@pytest.fixture(scope="module")
def hub(checkpoint, drafter):
    """Every built-in model's id serves the checkpoint, every published drafter's the drafter."""
    repos = {spec.model_path: checkpoint for spec in BUILTIN_MODELS.values()}
    drafters = {spec.dflash_drafter for spec in BUILTIN_MODELS.values() if spec.dflash_drafter}
    with running_hub({**repos, **dict.fromkeys(drafters, Path(drafter))}) as hub:
        yield hub


def fill_cache(hub, cache: Path, monkeypatch) -> None:
    """This process's Hub cache: every id the stand-in serves, downloaded from it into `cache`;
    then offline, so the start checks resolve the printed ids from there."""
    for repo in hub.repos:
        snapshot_download(repo, endpoint=hub.url, cache_dir=cache, allow_patterns=CHECKPOINT_FILES)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_every_hostable_planned_command_passes_the_start_checks_and_runs(
    checkpoint, hub, tmp_path_factory, monkeypatch
):
    pairs = [(hw, m) for hw in HARDWARE if not HARDWARE[hw].is_cpu for m in BUILTIN_MODELS]
    found = planned(pairs) + planned([("CPU", str(checkpoint))], input_len=64, output_len=32)
    layouts = {" ".join(key.split()[:4]) for key, _ in found}
    # every layout that fits: GB300's three and the CPU plan's
    assert layouts == {"tp1 dp1 ep1 dpa0", "tp4 dp1 ep1 dpa0", "tp4 dp4 ep1 dpa1",
                       "tp4 dp4 ep4 dpa1"}  # fmt: skip
    fill_cache(hub, tmp_path_factory.mktemp("checks_cache"), monkeypatch)
    runnable: dict[str, list[str]] = {}
    for key, argv in found:
        flags = rewrite(argv)
        refusal = start_check(flags)
        assert refusal is None, f"the planner printed a refused {shlex.join(argv)}: {refusal}"
        if len(flags) > len(runnable.get(key, [])):
            runnable[key] = flags
    for role in ("prefill", "decode"):  # --tp N, and under DP attention
        assert {key.split()[0] for key in runnable if key.endswith(role)} == {"tp1", "tp4"}
        assert any(" dpa1 " in key for key in runnable if key.endswith(role))
    assert set(STARTED) <= set(runnable)
    first: dict[str, tuple[str, float]] = {}
    home = tmp_path_factory.mktemp("hf_home")  # the servers' own cache, empty at first
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
           "HF_HUB_OFFLINE": "0"}  # fmt: skip
    asked, resolved = len(hub.requests), set()
    for key, sizes in STARTED.items():
        flags = resized(runnable[key], sizes)
        printed = flags[flags.index("--model-path") + 1]
        with running_server(None, *flags, env=env) as server:
            client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=300)
            with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched (and across DP groups)
                outs = list(pool.map(_greedy, [client] * len(PROMPTS), PROMPTS))
            assert all(len(out.logprobs.tokens) == 2 for out in outs), key
            first[key] = outs[0].logprobs.tokens[0], outs[0].logprobs.token_logprobs[0]
            info = httpx.get(server.url + "/get_server_info", timeout=60).json()["internal_states"]
            if "plain" not in key:  # the drafter ran: every verify emits at least one token
                assert info[0]["avg_spec_accept_length"] >= 1.0, (key, info[0])
            assert info[0].get("spec_algorithm") == ("DFLASH" if "dflash" in key else None), key
            if "dpa1" in key:
                assert len(info[0]["dp_groups"]) == 4, key
                assert "DeepEP is not available" in server.output()  # --moe-a2a-backend deepep
            model_info = httpx.get(server.url + "/get_model_info", timeout=60).json()
            assert model_info["model_path"] == printed, key  # the id as printed, or the folder
            pgid = server.process.pid
        assert not group_members(pgid), f"{key}: processes left"
        if not Path(printed).is_dir():  # resolved by the server: downloaded, then from the cache
            again = printed in resolved
            said = f"{printed}: found in the cache" if again else f"downloading {printed} from"
            assert said in server.output(), key
            resolved.add(printed)
    served = [path for method, path in hub.requests[asked:] if method == "GET"
              and path.endswith("/model.safetensors")]  # fmt: skip
    assert served and len(served) == len(set(served)), served  # each id's weights fetched once
    # the first greedy token of a 12-token prompt, from the logits of its last row, whatever the
    # layout: DP attention gathers each group's logits rows (not its forward rows) for the LM head
    token, logprob = first["tp1 dp1 ep1 dpa0 plain"]
    for key, (other_token, other_logprob) in first.items():
        assert other_token == token and abs(other_logprob - logprob) < 1e-2, key


def resized(flags: list[str], sizes: dict[str, str]) -> list[str]:
    """`flags` with the values of the flags named in `sizes` replaced (a layout halved)."""
    return [sizes.get(flags[i - 1], flag) if i else flag for i, flag in enumerate(flags)]


def _greedy(client: openai.OpenAI, prompt: str):
    out = client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0,
                                    logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
    return out.choices[0]
