"""The deployment guide's rules, each encoded once, in the order the planner applies them.

Layout rules come first (hardware, recipe, context parallelism, speculative decoding, KV cache,
roles, memory fraction); the fit checks that follow are in `dsaserve.deploy.checks`.
"""

from __future__ import annotations

from dsaserve.deploy.commands import BOOTSTRAP_PORT
from dsaserve.deploy.layout import Layout, Speculative
from dsaserve.deploy.rule_list import Refuse, RuleList

LOW_LATENCY_MTP = Speculative("EAGLE", 5, 1, 6)
BALANCED_MTP = Speculative("EAGLE", 1, 1, 2)
GUIDE_RULES = RuleList()
rule = GUIDE_RULES.rule


# ---------------------------------------------------------------- hardware and precision


@rule("nvfp4-blackwell-only", "NVFP4 checkpoints run on Blackwell only (native FP4 MMA is SM100+).")
def _nvfp4_blackwell(lay: Layout) -> str | None:
    if lay.model.precision == "nvfp4" and not lay.hardware.is_blackwell:
        hw = lay.hardware
        raise Refuse(f"{hw.name} is {hw.arch}; NVFP4 needs B200, B300 or GB300")
    return None


@rule("amd-single-node", "AMD (MI300X/MI325X/MI355X) recipes are single-node at tp 8.")
def _amd_single_node(lay: Layout) -> str | None:
    if lay.hardware.is_amd and lay.nodes > 1:
        raise Refuse(f"{lay.nodes} nodes of {lay.hardware.name}: no multi-node ROCm layout")
    return None


# ---------------------------------------------------------------- recipes


@rule("recipe-low-latency", "low-latency: TP over every GPU, EAGLE MTP 5/1/6.")
def _low_latency(lay: Layout) -> str | None:
    if lay.request.recipe != "low-latency":
        return None
    lay.tp, lay.recipe_mtp = lay.gpus, LOW_LATENCY_MTP
    return f"TP{lay.tp}"


def _dp_attention_deepep(lay: Layout) -> None:
    lay.tp = lay.dp = lay.ep = lay.gpus
    lay.dp_attention, lay.moe_a2a_backend = True, "deepep"


@rule("recipe-balanced", "balanced: DP attention + expert parallel (DeepEP), EAGLE MTP 1/1/2.")
def _balanced(lay: Layout) -> str | None:
    if lay.request.recipe != "balanced":
        return None
    _dp_attention_deepep(lay)
    lay.recipe_mtp = BALANCED_MTP
    return f"TP{lay.tp} DP{lay.dp} EP{lay.ep}"


@rule("recipe-high-throughput", "high-throughput: DP attention + expert parallel (DeepEP).")
def _high_throughput(lay: Layout) -> str | None:
    if lay.request.recipe != "high-throughput":
        return None
    _dp_attention_deepep(lay)
    return f"TP{lay.tp} DP{lay.dp} EP{lay.ep}"


@rule(
    "dp-attention-choice",
    "--dp-attention on/off overrides the recipe: on = DP attention + DeepEP over every GPU, "
    "off = plain TP.",
)
def _dp_attention_choice(lay: Layout) -> str | None:
    choice = lay.request.dp_attention
    if choice == "off" and lay.dp_attention:
        lay.plain_tp()
        return f"TP{lay.tp}, no DP attention"
    if choice == "on" and not lay.dp_attention:
        _dp_attention_deepep(lay)
        return f"TP{lay.tp} DP{lay.dp} EP{lay.ep}"
    return None


def _refuse_forced_dp_attention(lay: Layout, why: str) -> None:
    if lay.request.dp_attention == "on":
        raise Refuse(f"--dp-attention on: {why}")


@rule("balanced-long-prefill", "balanced with long inputs (8K+): --chunked-prefill-size 32768.")
def _long_prefill(lay: Layout) -> str | None:
    if lay.request.recipe != "balanced" or lay.request.input_len < 8192:
        return None
    lay.flags["--chunked-prefill-size"] = "32768"
    return f"input {lay.request.input_len} tokens"


@rule("cpu-tp-only", "CPU: plain TP, --device cpu, no MTP unless asked; DP attention needs GPUs.")
def _cpu(lay: Layout) -> str | None:
    if not lay.hardware.is_cpu:
        return None
    if lay.dp_attention:
        raise Refuse(f"{lay.request.recipe} needs DP attention and DeepEP, which need GPUs")
    lay.recipe_mtp = None
    lay.flags["--device"] = "cpu"
    return "--device cpu"


@rule("bf16-plain-tp", "BF16 runs plain TP: the guide's BF16 cells have no DP attention.")
def _bf16_plain_tp(lay: Layout) -> str | None:
    if lay.model.precision != "bf16" or not lay.dp_attention:
        return None
    _refuse_forced_dp_attention(lay, "the BF16 layouts are plain TP")
    lay.plain_tp()
    return f"TP{lay.tp}, no DP attention or DeepEP"


@rule("nvfp4-no-deepep", "NVFP4 runs DP attention without DeepEP (the default MoE path).")
def _nvfp4_no_deepep(lay: Layout) -> str | None:
    if lay.model.precision != "nvfp4" or lay.moe_a2a_backend != "deepep":
        return None
    lay.moe_a2a_backend, lay.ep = None, 1
    return "no --moe-a2a-backend deepep"


@rule(
    "amd-rocm",
    "AMD: plain TP8 with the DSA tilelang backends, --chunked-prefill-size 131072 (unless the "
    "recipe sets one) and --watchdog-timeout 1200 (weight loading is slow).",
)
def _amd_rocm(lay: Layout) -> str | None:
    if not lay.hardware.is_amd:
        return None
    _refuse_forced_dp_attention(lay, f"{lay.hardware.name} recipes are plain TP8")
    lay.plain_tp()
    lay.flags["--dsa-prefill-backend"] = lay.flags["--dsa-decode-backend"] = "tilelang"
    lay.flags.setdefault("--chunked-prefill-size", "131072")
    lay.flags["--watchdog-timeout"] = "1200"
    return f"TP{lay.tp}, tilelang"


# ---------------------------------------------------------------- context parallelism


@rule("cp-no-zigzag", "zigzag context parallelism is unavailable: use interleave with --dp 1.")
def _cp_zigzag(lay: Layout) -> str | None:
    if lay.request.context_parallel == "zigzag":
        raise Refuse("--context-parallel zigzag is unavailable; use --context-parallel interleave")
    return None


@rule("cp-not-on-decode", "Prefill context parallelism is not for PD decode workers.")
def _cp_decode(lay: Layout) -> str | None:
    if lay.request.context_parallel and lay.request.pd == "decode":
        raise Refuse("--context-parallel with --pd decode: prefill CP runs on prefill workers")
    return None


@rule("cp-hopper-only", "DSA prefill CP is verified on Hopper only (not Blackwell, not ROCm).")
def _cp_hopper(lay: Layout) -> str | None:
    if lay.request.context_parallel and not lay.hardware.is_hopper:
        raise Refuse(f"--context-parallel on {lay.hardware.name} ({lay.hardware.arch})")
    return None


@rule("cp-kv-unquantised", "dsaserve's CP all-gathers move unquantised entries: KV bf16.")
def _cp_kv(lay: Layout) -> str | None:
    if lay.request.context_parallel and lay.request.kv_cache_dtype == "fp8_e4m3":
        raise Refuse("--context-parallel with --kv-cache-dtype fp8_e4m3: use the default KV dtype")
    return None


@rule("cp-single-node", "Prefill CP needs tp <= 8 (a single node).")
def _cp_single_node(lay: Layout) -> str | None:
    if lay.request.context_parallel and lay.tp > 8:
        raise Refuse(f"--context-parallel at TP{lay.tp} ({lay.nodes} nodes)")
    return None


@rule("cp-interleave", "Interleave CP has no DP attention: --dp 1, --attn-cp-size = tp.")
def _cp_interleave(lay: Layout) -> str | None:
    if not lay.request.context_parallel:
        return None
    _refuse_forced_dp_attention(lay, "interleave context parallelism runs with --dp 1")
    lay.plain_tp()
    lay.flags.update({"--enable-prefill-cp": None, "--cp-strategy": "interleave"})
    lay.flags["--attn-cp-size"] = str(lay.tp)
    return f"attn-cp-size {lay.tp}"


# ---------------------------------------------------------------- speculative decoding


@rule("amd-no-mtp", "AMD: no MTP (the DSA draft path is not validated on ROCm).")
def _amd_no_mtp(lay: Layout) -> str | None:
    if not lay.hardware.is_amd:
        return None
    if lay.request.speculative == "mtp":
        raise Refuse(f"--speculative mtp on {lay.hardware.name}; use --speculative none")
    had_mtp, lay.recipe_mtp = lay.recipe_mtp, None
    return "MTP off" if had_mtp else None


@rule("mtp-needs-nextn", "MTP drafting needs the checkpoint's nextn layer.")
def _mtp_nextn(lay: Layout) -> str | None:
    if lay.model.has_mtp:
        return None
    if lay.request.speculative == "mtp":
        raise Refuse(f"{lay.model.name} has num_nextn_predict_layers = 0")
    had_mtp, lay.recipe_mtp = lay.recipe_mtp, None
    return "MTP off" if had_mtp else None


@rule(
    "speculative",
    "--speculative auto follows the recipe; mtp forces MTP (1/1/2 if the recipe has none); "
    "dflash2 drafts with the model's DFlash2 drafter (SGLang's DFLASH; --draft-model overrides).",
)
def _speculative(lay: Layout) -> str:
    choice = lay.request.speculative
    if choice == "dflash2":
        drafter = lay.request.draft_model or lay.model.dflash_drafter
        if drafter is None:
            raise Refuse(f"--speculative dflash2: no DFlash drafter is known for "
                         f"{lay.model.name}; pass --draft-model PATH")  # fmt: skip
        # SGLang's spelling (DFlash2 drafters run as DFLASH); the block size is the drafter's
        lay.speculative = Speculative("DFLASH", draft_model_path=drafter)
    elif choice == "mtp":
        lay.speculative = lay.recipe_mtp or BALANCED_MTP
    else:
        lay.speculative = lay.recipe_mtp if choice == "auto" else None
    return lay.speculative.describe() if lay.speculative else "off"


def _dflash(lay: Layout) -> bool:
    return bool(lay.speculative and lay.speculative.algorithm == "DFLASH")


@rule("dflash2-no-dp-attention", "DFlash2 drafting refuses DP attention (as SGLang's DFLASH).")
def _dflash2(lay: Layout) -> str | None:
    if _dflash(lay) and lay.dp_attention:
        raise Refuse(f"--speculative dflash2 with the {lay.request.recipe} recipe's DP attention")
    return None


@rule("dflash2-no-pd-hicache",
      "DFlash2 drafting runs without PD roles and HiCache: the drafter's context entries would "
      "have to move with the KV (dsaserve serve refuses both).")  # fmt: skip
def _dflash2_alone(lay: Layout) -> str | None:
    if not _dflash(lay):
        return None
    if lay.request.pd is not None:
        raise Refuse(f"--speculative dflash2 with --pd {lay.request.pd}: a PD role does not move "
                     "the drafter's context; use --speculative mtp")  # fmt: skip
    if lay.request.hicache:
        raise Refuse("--speculative dflash2 with --hicache: host pages lack the drafter's "
                     "entries; use --speculative mtp")  # fmt: skip
    return None


# ---------------------------------------------------------------- KV cache


@rule("fp8-kv-nvidia-only", "FP8 KV is for NVIDIA GPUs (and CPU, dsaserve's own); ROCm keeps bf16.")
def _fp8_kv_nvidia(lay: Layout) -> str | None:
    fp8_ok = lay.hardware.vendor == "nvidia" or lay.hardware.is_cpu
    if lay.request.kv_cache_dtype == "fp8_e4m3" and not fp8_ok:
        raise Refuse(f"--kv-cache-dtype fp8_e4m3 on {lay.hardware.name}")
    return None


def _auto_kv_dtype(lay: Layout) -> str:
    if lay.hardware.is_blackwell:
        return "fp8_e4m3"
    if lay.hardware.is_cpu and lay.model.precision == "fp32":
        return "fp32"
    return "bf16"


@rule("kv-dtype-auto", "KV dtype auto: bf16 on Hopper (and ROCm), fp8_e4m3 on Blackwell.")
def _kv_dtype(lay: Layout) -> str:
    auto = _auto_kv_dtype(lay)
    asked = lay.request.kv_cache_dtype
    lay.kv_dtype = auto if asked == "auto" else asked
    if lay.kv_dtype != auto:
        lay.flags["--kv-cache-dtype"] = lay.kv_dtype
    return lay.kv_dtype if asked == "auto" else f"{lay.kv_dtype} (auto would be {auto})"


@rule(
    "hopper-fp8-kv",
    "FP8 KV on Hopper pairs --kv-cache-dtype fp8_e4m3 with --dsa-prefill-backend "
    "flashmla_sparse_q8 --dsa-decode-backend flashmla_kv.",
)
def _hopper_fp8_kv(lay: Layout) -> str | None:
    if not (lay.hardware.is_hopper and lay.kv_dtype == "fp8_e4m3"):
        return None
    lay.flags["--dsa-prefill-backend"] = "flashmla_sparse_q8"
    lay.flags["--dsa-decode-backend"] = "flashmla_kv"
    return "flashmla_sparse_q8 / flashmla_kv"


# ---------------------------------------------------------------- serving roles and caches


@rule(
    "pd-disaggregation",
    "PD: prefill and decode workers behind sglang-router; KV moves by "
    "--disaggregation-transfer-backend (mooncake or nixl); the prefill's bootstrap server on 8998.",
)
def _pd(lay: Layout) -> str | None:
    role = lay.request.pd
    if role not in ("prefill", "decode"):
        return None
    backend = lay.request.pd_transfer_backend
    if backend == "auto":
        backend = "nixl" if lay.hardware.is_cpu else "mooncake"
    lay.flags["--disaggregation-mode"] = role
    lay.flags["--disaggregation-transfer-backend"] = backend
    lay.flags["--disaggregation-bootstrap-port"] = str(BOOTSTRAP_PORT)
    return f"{role} worker, KV over {backend}"


@rule(
    "hicache",
    "HiCache: host KV tier of --hicache-ratio 2 x the device pool (indexer keys too), with "
    "--hicache-write-policy and an optional --hicache-storage-backend below it.",
)
def _hicache(lay: Layout) -> str | None:
    request = lay.request
    if not request.hicache:
        return None
    lay.flags.update({"--enable-hierarchical-cache": None, "--hicache-ratio": "2"})
    lay.flags["--hicache-write-policy"] = request.hicache_write_policy
    if request.hicache_storage:
        lay.flags["--hicache-storage-backend"] = request.hicache_storage
    storage = f", storage {request.hicache_storage}" if request.hicache_storage else ""
    return f"--hicache-ratio 2, {request.hicache_write_policy}{storage}"


# (precision, hardware or None, multi-node or None) -> --mem-fraction-static; first match wins
MEM_FRACTIONS: list[tuple[str | None, str | None, bool | None, float]] = [
    ("nvfp4", None, None, 0.85),
    (None, "GB300", None, 0.85),  # 4-GPU node: higher than the 8-GPU FP8 start
    ("bf16", None, True, 0.85),
    ("bf16", "B300", False, 0.9),
    (None, None, None, 0.8),  # FP8 on an 8-GPU node (H200 TP8)
]


@rule(
    "mem-fraction",
    "--mem-fraction-static: FP8 starts at 0.8 on 8-GPU nodes (H200 TP8), 0.85 on GB300 TP4; "
    "BF16 0.9 on 8xB300, 0.85 multi-node; NVFP4 0.85.",
)
def _mem_fraction(lay: Layout) -> str:
    if lay.request.mem_fraction_static is not None:
        lay.mem_fraction = lay.request.mem_fraction_static
        return f"{lay.mem_fraction} (asked)"
    multi_node = lay.nodes > 1
    lay.mem_fraction = next(
        value
        for precision, hw, multi, value in MEM_FRACTIONS
        if precision in (None, lay.model.precision)
        and hw in (None, lay.hardware.name)
        and multi in (None, multi_node)
    )
    return str(lay.mem_fraction)
