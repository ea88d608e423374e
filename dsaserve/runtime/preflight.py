"""Every flag checked once, before any process starts: a one-line `ArgsError` naming the flag.

`ServerArgs` checks each value and the combinations of flags alone when it is built (args.py);
`preflight` adds what needs the device or the checkpoint: flags this build parses (SGLang's names)
but cannot run, an internal surface that would listen beyond loopback without the cluster secret
(cluster/addresses.py), the parallel layout against the model's shapes (distributed/checks.py),
the MTP layer EAGLE needs, the drafter DFLASH needs (its flags, and its fit to the target).
`dsaserve serve` (every node) and the offline `LLM` call it; what they start afterwards
(`Engine`, the ranks) trusts its arguments.
"""

from __future__ import annotations

import json

from dsaserve.args import ArgsError, ServerArgs, speculative_settings
from dsaserve.cluster.addresses import exposure_error
from dsaserve.dflash_args import dflash_settings
from dsaserve.distributed.checks import check_context_parallel, check_parallel, moe_backend_note
from dsaserve.distributed.parallel_state import ParallelSizes
from dsaserve.engine.startup import pick_device
from dsaserve.kernels.registry import BackendError, choose_kernels
from dsaserve.model_config import ConfigError, ModelConfig
from dsaserve.models.dflash_config import DFlashConfig

TRANSFER_BACKENDS = ("nixl", "mooncake")


def preflight(args: ServerArgs, offline: bool = False) -> list[str]:
    """Refuse what cannot run (ArgsError); return the notes to print at start. `offline`: the
    in-process `LLM` (no request sockets, so no DP attention groups)."""
    device_type = pick_device(args.device).type
    speculative_settings(args)  # e.g. EAGLE3 (parsed as SGLang's) is refused here
    refuse_unrunnable(args, device_type)
    exposed = exposure_error(args)  # an internal surface beyond loopback needs the cluster secret
    if exposed:
        raise ArgsError(exposed)
    config = checkpoint_config(args) if needs_checkpoint(args) else None
    check_layout(args, config, device_type)
    check_speculative_model(args, config)
    sizes = ParallelSizes.from_args(args)
    if offline and sizes.groups > 1:
        raise ArgsError("--enable-dp-attention with --dp > 1 needs the server (each group has "
                        "its own request socket); use dsaserve serve")  # fmt: skip
    if offline and sizes.replicas > 1:
        raise ArgsError(f"--dp {sizes.dp} replicas need the server (one engine process each, "
                        "behind its dispatch); use dsaserve serve")  # fmt: skip
    note = moe_backend_note(args, device_type)
    return [note] if note else []


def refuse_unrunnable(args: ServerArgs, device_type: str) -> None:
    """Refuse flags this build parses (for SGLang compatibility) but cannot run."""
    check_context_parallel(args)
    backend = args.disaggregation_transfer_backend
    if args.disaggregation_mode != "null" and backend not in TRANSFER_BACKENDS:
        raise ArgsError(f"--disaggregation-transfer-backend {backend} is not available; use "
                        "nixl or mooncake")  # fmt: skip
    try:
        choose_kernels(args, device_type)
    except BackendError as e:
        raise ArgsError(str(e)) from None


def single_rank(args: ServerArgs) -> bool:
    sizes = (args.tp_size, args.dp_size, args.ep_size, args.nnodes)
    return sizes == (1, 1, 1, 1) and not args.enable_dp_attention


def needs_checkpoint(args: ServerArgs) -> bool:
    return not single_rank(args) or args.speculative_algorithm is not None


def checkpoint_config(args: ServerArgs) -> ModelConfig:
    try:
        return ModelConfig.from_hf(
            args.model_path, json.loads(args.json_model_override_args or "{}")
        )
    except ConfigError as e:
        raise ArgsError(str(e)) from None


def check_layout(
    args: ServerArgs, config: ModelConfig | None = None, device_type: str | None = None
) -> None:
    """Refuse a parallel layout that cannot work with this checkpoint on this machine."""
    if single_rank(args):
        return
    device_type = device_type or pick_device(args.device).type
    check_parallel(args, config or checkpoint_config(args), device_type)


def check_speculative_model(args: ServerArgs, config: ModelConfig | None) -> None:
    if config is None or args.speculative_algorithm is None:
        return
    dflash = dflash_settings(args)
    if dflash is not None:  # a separate drafter: it must fit the target (one line, the field)
        try:
            DFlashConfig.from_dir(dflash.draft_path).check_fits(config)
        except ConfigError as e:
            raise ArgsError(str(e)) from None
        return
    if config.num_nextn_predict_layers < 1:
        raise ArgsError(
            f"--speculative-algorithm {args.speculative_algorithm}: the checkpoint "
            f"{args.model_path} has no MTP (nextn) layer (num_nextn_predict_layers is 0); "
            "drop --speculative-algorithm or use a checkpoint that ships its MTP layer"
        )
