"""Every `dsaserve serve` flag as data: its names (SGLang's, then the aliases SGLang accepts), what
it does, and its default as a reader should see it where the value alone does not say it.

`args.add_server_args` declares these on a parser (the values' defaults come from `ServerArgs`);
`scripts/flags_doc.py` writes docs/flags.md from the same table, so `dsaserve serve --help`, the
docs and the parser cannot drift apart. A flag that is parsed but does nothing here says so in its
help: which flags are real matters to users.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsaserve.kernels.registry import (
    ATTENTION_BACKENDS,
    DSA_BACKENDS,
    FP8_GEMM_BACKENDS,
    MOE_BACKENDS,
)

ACCEPTED = "accepted for SGLang command lines; nothing in dsaserve reads it"


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the first names the ServerArgs field (--tp-size -> tp_size)
    help: str
    default: str | None = None  # shown instead of ServerArgs' value ("from memory", "off (...)")
    kw: dict[str, Any] = field(default_factory=dict)  # argparse's: type, choices, action, dest


def flag(*names: str, help: str, default: str | None = None, **kw: Any) -> Flag:
    return Flag(names, help, default, kw)


ON = {"action": "store_true"}

MODEL = (
    flag("--model-path", "--model", default="the embedded model", help="checkpoint folder "
         "(`config.json`, safetensors, tokenizer, `chat_template.jinja`) or a Hub id "
         "(`zai-org/GLM-5.3`: the cache, else downloaded; docs/server.md, Checkpoints)"),
    flag("--tokenizer-path", default="the model's", help="tokenizer and chat template folder or "
         "Hub id"),
    flag("--revision", default="main", help="branch, tag or commit of the `--model-path` Hub id "
         "(and of `--tokenizer-path` when it names the same id)"),
    flag("--download-dir", default="`$HF_HUB_CACHE` (`$HF_HOME/hub`)", help="the Hugging Face "
         "cache Hub ids resolve in (`HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` apply)"),
    flag("--served-model-name", default="the Hub id, else the folder name", help="the `model` "
         "id `/v1/models` reports"),
    flag("--dtype", choices=["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"],
         help="compute dtype: auto = the checkpoint's (bf16 for FP8 checkpoints); fp32 or bf16 "
         "on CPU"),
    flag("--context-length", type=int, default="the model's", help="longest prompt + output, "
         "in tokens"),
    flag("--json-model-override-args", help="JSON merged over the checkpoint's `config.json`"),
    flag("--trust-remote-code", **ON, help="also download a Hub id's `*.py` files, and pass "
         "`trust_remote_code` to the tokenizer"),
    flag("--device", choices=["auto", "cpu", "cuda"], help="auto = CUDA when available, else "
         "CPU"),
    flag("--random-seed", type=int, help="the sampler's seed"),
)  # fmt: skip

HTTP = (
    flag("--host", help="address to listen on"),
    flag("--port", type=int, help="port to listen on (0: any free port, printed when ready)"),
    flag("--api-key", default="`$DSASERVE_API_KEY`", help="Bearer (and `x-api-key`) key for "
         "every inference and admin route (and `/openapi.json`); the environment variable keeps "
         "it out of `ps`"),
    flag("--cluster-secret", default="`$DSASERVE_CLUSTER_SECRET`, else the API key",
         help="authenticates the ports dsaserve opens for its own processes (PD bootstrap, KV "
         "channel; docs/server.md, Ports); without one they listen on loopback only"),
    flag("--reasoning-parser", choices=["auto", "glm45", "deepseek-v3", "none"], help="auto: "
         "from the chat template, or DeepSeek-V3.2's config"),
    flag("--tool-call-parser", choices=["auto", "glm47", "glm45", "deepseekv32", "none"],
         help="auto: from the chat template"),
    flag("--default-chat-template-kwargs", help="JSON object merged under each request's "
         "`chat_template_kwargs`, e.g. '{\"enable_thinking\": false}'"),
    flag("--enable-metrics", **ON, help="Prometheus `/metrics` under SGLang's metric names "
         "(`sglang:cached_tokens_total{cache_source}`, ...; docs/server.md, Metrics)"),
    flag("--enable-cache-report", **ON, help="accepted for SGLang command lines: "
         "the cache report is on unless `--disable-cache-report`"),
    flag("--disable-cache-report", dest="enable_cache_report", action="store_false",
         default="off (the report is on)", help="omit `prompt_tokens_details.cached_tokens` "
         "(OpenAI) and `cache_read_input_tokens` (Anthropic, reported 0); the report counts "
         "device, host and storage hits"),
    flag("--grammar-backend", choices=["xgrammar", "llguidance", "none"], help="structured "
         "output: `xgrammar`, `llguidance` (tool-call grammars written as Lark), `none` (grammar "
         "fields are a 400)"),
    flag("--keep-anthropic-billing-header", **ON, help="keep Claude Code's per-request "
         "`x-anthropic-billing-header` system line in the prompt (dropped by default so the "
         "prefix cache hits)"),
    flag("--max-queued-requests", type=int, help="waiting requests beyond which a request gets "
         "429 with `Retry-After` (none: unlimited)"),
    flag("--watchdog-timeout", type=float, help="seconds one engine step may take before the "
         "engine process is declared dead (then 503s)"),
    flag("--disable-custom-all-reduce", **ON, help="CPU ranks of one node: collectives over "
         "gloo instead of shared memory (docs/parallel.md)"),
    flag("--shutdown-timeout", type=float, help="seconds SIGTERM waits for in-flight requests "
         "before aborting them"),
    flag("--log-level", choices=["debug", "info", "warning", "error"], help="`debug` also logs "
         "every HTTP request"),
    flag("--skip-server-warmup", **ON, help=f"{ACCEPTED} (dsaserve sends no warm-up request)"),
    flag("--skip-memory-check", **ON, help="start even when the weights + KV pool seem not to "
         "fit (otherwise: exit 2 before loading, with the numbers and a `dsaserve plan` line "
         "that fits)"),
    flag("--max-request-bytes", type=int, default="32 MiB", help="body size limit (413)"),
    flag("--max-n", type=int, help="most choices (`n`) one request may ask for"),
    flag("--max-sequences-per-request", type=int, help="most engine sequences (prompts x `n`) "
         "of one request"),
    flag("--responses-store-size", type=int, help="most `/v1/responses` kept for `store: true` "
         "(in memory, LRU, at most 256 MiB; 0: none, and `store: true` is a 400)"),
    flag("--header-timeout", type=float, help="seconds a client has to send its request "
         "headers (and the most that may pass between two pieces of its body)"),
)  # fmt: skip

MEMORY = (
    flag("--mem-fraction-static", type=float, default="0.85 GPU / 0.05 CPU", help="memory "
         "share for the KV pool when `--max-total-tokens` is unset"),
    flag("--max-total-tokens", type=int, default="from memory", help="KV pool size in tokens "
         "(else `--mem-fraction-static` of memory)"),
    flag("--page-size", type=int, default="64", help="tokens per KV page"),
    flag("--chunked-prefill-size", type=int, default="8192 GPU / 2048 CPU", help="prefill "
         "tokens per step (-1: no chunking)"),
    flag("--max-prefill-tokens", type=int, help=ACCEPTED),
    flag("--max-running-requests", type=int, default="256 GPU / 64 CPU", help="concurrent "
         "requests in the batch"),
    flag("--disable-radix-cache", **ON, help="turn prefix caching off"),
    flag("--schedule-policy", choices=["fcfs", "lpm"], help=f"{ACCEPTED} (requests run first "
         "come, first served)"),
    flag("--radix-eviction-policy", choices=["lru"], help=f"{ACCEPTED} (the radix cache evicts "
         "least recently used)"),
    flag("--kv-cache-dtype", help="`fp8_e4m3` (FlashMLA layout, CPU and GPU), `bf16`, `fp32`; "
         "auto = the compute dtype, fp8 on Blackwell"),
)  # fmt: skip

KERNELS = (
    flag("--attention-backend", choices=list(ATTENTION_BACKENDS), default="auto",
         help="validated as `--dsa-decode-backend`; prefill runs the torch path in this build"),
    flag("--dsa-prefill-backend", "--nsa-prefill-backend", choices=list(DSA_BACKENDS),
         default="auto", help="validated as `--dsa-decode-backend`; prefill runs the torch path "
         "in this build"),
    flag("--dsa-decode-backend", "--nsa-decode-backend", choices=list(DSA_BACKENDS),
         default="auto", help="indexer + sparse MLA decode: `torch`, `triton` (auto on CUDA); "
         "`flashmla_sparse` / `flashmla_kv` / `flashmla_auto`: the FlashMLA adapter on CUDA "
         "where `flash_mla` imports (never run), else our Triton kernels; other SGLang names "
         "(`fa3`, ...) run our Triton kernels on CUDA; all refused on CPU"),
    flag("--moe-runner-backend", choices=list(MOE_BACKENDS), help="routed experts: `torch` "
         "(dequantised on load; the static decode path's gathered / dense forms) or `triton` "
         "(grouped GEMMs, `kernels/triton_moe.py`; an FP8 checkpoint's experts kept FP8 and run "
         "by it in prefill and decode, on every rank under `--tp` / `--ep` where the rank's "
         "slice of I is a multiple of 128); auto = triton on CUDA, on CPU the `cpu` ops (an "
         "FP8 checkpoint's experts kept FP8, an NVFP4 one's kept 4-bit on one rank: read as "
         "stored by the native decode, one busy expert dequantised at a time elsewhere, "
         "`kernels/cpu_fp8.py`); `deep_gemm`: the "
         "DeepGEMM adapter on CUDA where it imports (never run), else triton; other SGLang "
         "names run triton on CUDA; refused on CPU"),
    flag("--fp8-gemm-backend", choices=list(FP8_GEMM_BACKENDS), help="block-FP8 Linears: "
         "`torch` (dequantised on load) or `triton` (weights kept FP8, each rank its slice "
         "where it falls on 128-blocks; auto on CUDA); auto on CPU: the `cpu` op (kept FP8: "
         "the native decode reads e4m3 + scales, the layered path dequantises 1024 rows at a "
         "time); `deep_gemm`: the DeepGEMM adapter on CUDA where `deep_gemm` imports (never "
         "run), else triton; refused on CPU"),
    flag("--disable-cuda-graph", **ON, help="run decode steps eagerly on CUDA (CPU never "
         "captures)"),
    flag("--cuda-graph-max-bs", type=int, default="the running-request limit, at most 256",
         help="largest decode batch captured; buckets 1, 2, 4, 8, then every 8 (SGLang's), and "
         "with MTP each bucket x (steps + 1) verify rows (CUDA only)"),
    flag("--disable-fused-decode", **ON, help="run all-decode steps through the layered model "
         "instead of the fused decode path (one rank, torch kernels; native: fp32 / bf16 "
         "weights and an fp32, bf16 or FP8 KV cache; Python: fp32 only)"),
    flag("--disable-native-decode", **ON, help="keep the fused decode path in Python instead of "
         "its C++ form (`kernels/cpu_decode.cpp`, built with the machine's `c++` at first use, "
         "~30 s, cached in `~/.cache/torch_extensions`; a dead build's lock is taken over, a live "
         "one waited on up to `DSASERVE_NATIVE_BUILD_TIMEOUT` (600 s); without a compiler, on a "
         "compile error or at the timeout the Python path runs with one warning; "
         "`kernels/native_build.py`), and a DFLASH drafter's block forward and context entries "
         "in torch instead of `kernels/dflash_block.cpp`"),
    flag("--enable-torch-compile", **ON, help="`torch.compile` the fused decode step (dynamic "
         "shapes; compiles for minutes on a CPU)"),
    flag("--threads", type=int, default="`OMP_NUM_THREADS` if set, else the physical cores",
         help="CPU threads for the engine's kernels and the native decode pool, per rank "
         "(ranks without it: their `SGLANG_CPU_OMP_THREADS_BIND` range, else the cores shared "
         "out; docs/parallel.md) (`/get_server_info` and `dsaserve bench` report them); the "
         "engine processes get "
         "`GOMP_SPINCOUNT=10000` unless `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` is set "
         "(`runtime/omp.py`)"),
)  # fmt: skip

SPECULATIVE = (
    flag("--speculative-algorithm", choices=["EAGLE", "NEXTN", "EAGLE3", "DFLASH", "DFLASH2"],
         default="off", help="`EAGLE` (or `NEXTN`): draft with the checkpoint's MTP layer; "
         "`DFLASH` / `DFLASH2`: draft a whole block with a DFlash / DFlash2 drafter "
         "(z-lab/dflash's format) and verify it in one target forward; `EAGLE3` is parsed and "
         "refused at start"),
    flag("--speculative-num-steps", type=int, default="3", help="draft steps per round; "
         "DFLASH: forced to 1 (warned)"),
    flag("--speculative-eagle-topk", type=int, default="1", help="draft branching: 1 only "
         "(tree drafting is refused); DFLASH: forced to 1 (warned)"),
    flag("--speculative-num-draft-tokens", type=int, default="steps + 1 (4)", help="tokens "
         "verified per round: steps + 1; DFLASH: the block size"),
    flag("--speculative-draft-model-path", "--speculative-draft-model",
         default="the embedded drafter with the embedded model", help="the DFlash / DFlash2 "
         "drafter folder or Hub id (resolved at `main`); one that does not fit the target "
         "(hidden size, vocab, target layer ids) is refused naming the field"),
    flag("--speculative-dflash-block-size", type=int,
         default="the drafter's `dflash_config.block_size`", help="DFLASH's verify window "
         "(alias of `--speculative-num-draft-tokens`)"),
    flag("--speculative-draft-window-size", type=int, default="the whole context",
         help="DFLASH: drafts attend only the last N context tokens"),
    flag("--speculative-draft-attention-backend", default="auto", help="the drafter's "
         "attention op: `torch`, `triton` (auto on CUDA); SGLang's names (`fa3`, `fa4`, ...) "
         "run the Triton kernel on CUDA"),
)  # fmt: skip

HICACHE = (
    flag("--enable-hierarchical-cache", **ON, help="HiCache: a host KV tier under the radix "
         "cache (docs/server.md, HiCache)"),
    flag("--hicache-ratio", type=float, help="host pool = ratio x the device pool"),
    flag("--hicache-size", type=int, help="host pool in GB (overrides the ratio; 0: use it)"),
    flag("--hicache-write-policy", choices=["write_through", "write_through_selective",
         "write_back"], help="when a page gets its host copy: `write_through` (first hit), "
         "`write_through_selective` (second hit), `write_back` (on eviction)"),
    flag("--hicache-mem-layout", choices=["layer_first", "page_first", "page_first_direct"],
         help="accepted; the host tier always mirrors the device layout"),
    flag("--hicache-io-backend", choices=["direct", "kernel", "kernel_ascend"],
         help="accepted; the host tier always mirrors the device layout"),
    flag("--hicache-storage-backend", choices=["file", "dynamic"], default="off",
         help="a storage tier under the host tier: `file` (a directory) or `dynamic` (your "
         "class)"),
    flag("--hicache-storage-backend-extra-config", help="JSON: `file_path`, `max_size_gb`, "
         "`prefetch_threshold`, `prefetch_timeout_base`, `prefetch_timeout_per_ki_token`, "
         "`module_path`, `class_name`"),
    flag("--hicache-storage-prefetch-policy", choices=["best_effort", "wait_complete",
         "timeout"], help="how long admission waits for a storage prefetch"),
)  # fmt: skip

PARALLEL = (
    flag("--tp-size", "--tp", "--tensor-parallel-size", type=int, help="ranks (tensor "
         "parallel): attention heads, MLPs, experts, vocab split N ways"),
    flag("--dp-size", "--dp", "--data-parallel-size", type=int, help="with "
         "`--enable-dp-attention`: N attention groups of tp / dp ranks, MoE over all ranks; "
         "alone: N data-parallel replicas, independent engines of `--tp` ranks each behind one "
         "server"),
    flag("--ep-size", "--ep", "--expert-parallel-size", type=int, help="expert parallel: whole "
         "experts split N ways (must divide `--tp`)"),
    flag("--enable-dp-attention", **ON, help="make `--dp` attention groups instead of "
         "replicas"),
    flag("--load-balance-method", choices=["round_robin", "shortest_queue"], help="DP dispatch "
         "(groups or replicas): `round_robin`, `shortest_queue` (a cached prefix wins)"),
    flag("--moe-a2a-backend", choices=["none", "deepep", "mooncake"], help="accepted; says at "
         "start that DeepEP kernels are not used yet: experts go through torch.distributed "
         "(all-reduce)"),
    flag("--enable-prefill-cp", "--enable-dsa-prefill-context-parallel", **ON,
         help="context-parallel prefill: a chunk's rows dealt round-robin to `--attn-cp-size` "
         "ranks"),
    flag("--cp-strategy", choices=["interleave", "zigzag"], default="interleave",
         help="`interleave` (needs `--dp 1`); `zigzag` is refused at start"),
    flag("--attn-cp-size", "--attention-context-parallel-size", type=int, help="context-"
         "parallel ranks: must equal `--tp`"),
    flag("--enable-dsa-cache-layer-split", **ON, help="LayerSplit: each CP rank keeps only its "
         "layers' KV, fetched from the owner per layer"),
    flag("--nnodes", type=int, help="nodes: node 0 serves HTTP, the others run ranks only "
         "(under DP attention their groups' engines, driven from node 0 over TCP)"),
    flag("--node-rank", type=int, help="this node's index among `--nnodes`"),
    flag("--dist-init-addr", help="node 0's host:port the nodes rendezvous at (on node 0, "
         "port 0: it takes a free port and prints `rendezvous on HOST:PORT` for the others)"),
    flag("--enable-flashinfer-allreduce-fusion", **ON, help=ACCEPTED),
)  # fmt: skip

PD = (
    flag("--disaggregation-mode", choices=["null", "prefill", "decode"], help="`prefill` or "
         "`decode`: a PD role behind `sglang-router --pd-disaggregation` (docs/disaggregation.md)"),
    flag("--disaggregation-transfer-backend", choices=["mooncake", "nixl", "mooncake_tcp",
         "fake"], help="`nixl` or `mooncake` (RDMA with an HCA, else TCP, logged loudly)"),
    flag("--disaggregation-bootstrap-port", type=int, help="the prefill's bootstrap server; a "
         "decode uses it when the router sends none"),
    flag("--disaggregation-advertise-host", default="auto", help="the address a role registers "
         "for its peers (else `$SGLANG_HOST_IP`, a concrete `--host`, the interface that reaches "
         "the peer)"),
    flag("--disaggregation-ib-device", default="auto", help="Mooncake's RDMA device"),
    flag("--disaggregation-timeout", type=float, help="seconds a room may wait for its KV "
         "(decode) or its destination (prefill)"),
    flag("--disaggregation-heartbeat-interval", type=float, help="seconds between a decode's "
         "heartbeats to each prefill"),
    flag("--disaggregation-checksum", **ON, help="debug: the decode checks every layer's "
         "received KV against the prefill's"),
)  # fmt: skip

SECTIONS: dict[str, tuple[Flag, ...]] = {
    "Model and tokenizer": MODEL,
    "HTTP and API": HTTP,
    "Memory and scheduling": MEMORY,
    "Kernels and decode paths": KERNELS,
    "Speculative decoding": SPECULATIVE,
    "HiCache": HICACHE,
    "Parallelism": PARALLEL,
    "PD disaggregation": PD,
}
