"""`--speculative-algorithm DFLASH`: its flags resolved and checked as SGLang does.

SGLang's spelling is `DFLASH` (a DFlash2 drafter is the same algorithm with another
architecture in its config.json); `DFLASH2` is accepted as the same, since the deployment
guide's card and `dsaserve plan --speculative dflash2` say DFlash2. As in SGLang
(`_handle_dflash`): the drafter comes from `--speculative-draft-model-path` (alias
`--speculative-draft-model`); the block size (the verify window) from the drafter's
`dflash_config.block_size` unless `--speculative-dflash-block-size` sets it, which is an alias of
`--speculative-num-draft-tokens` (both set: they must match); `--speculative-num-steps` and
`--speculative-eagle-topk` other than 1 are overridden to 1 with a warning; DP attention is
refused; `--speculative-draft-window-size` (>= the block size) limits the context each draft
attends to the most recent tokens. With the embedded model and no drafter path, the embedded
model's own drafter is used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from dsaserve.args import ArgsError, ServerArgs
from dsaserve.assets import default_drafter_path, default_model_path

logger = logging.getLogger(__name__)

DFLASH_ALGORITHMS = ("DFLASH", "DFLASH2")


@dataclass(frozen=True)
class DFlashSettings:
    draft_path: str
    block_size: int | None  # None: the drafter checkpoint's dflash_config.block_size
    window: int | None  # --speculative-draft-window-size


def is_dflash(args: ServerArgs) -> bool:
    return args.speculative_algorithm in DFLASH_ALGORITHMS


def dflash_settings(args: ServerArgs) -> DFlashSettings | None:
    """The DFLASH settings, None when another (or no) algorithm is chosen; ArgsError naming the
    flag for a combination that cannot run."""
    if not is_dflash(args):
        return None
    _refuse_layouts(args)
    for flag, value in (("num-steps", args.speculative_num_steps),
                        ("eagle-topk", args.speculative_eagle_topk)):  # fmt: skip
        if value is not None and value != 1:
            logger.warning("DFLASH only supports --speculative-%s 1; overriding %s to 1", flag,
                           value)  # fmt: skip
    block = _block_size(args)
    window = args.speculative_draft_window_size
    if window is not None and window < (block or 2):
        raise ArgsError(f"--speculative-draft-window-size {window} must be >= the block size "
                        f"({block or 2})")  # fmt: skip
    return DFlashSettings(_draft_path(args), block, window)


def _refuse_layouts(args: ServerArgs) -> None:
    if args.enable_dp_attention:
        raise ArgsError("Currently DFLASH speculative decoding does not support dp attention "
                        "(--enable-dp-attention), as in SGLang; drop it or use EAGLE")  # fmt: skip
    if args.dp_size > 1:
        raise ArgsError("--speculative-algorithm DFLASH with --dp > 1 is not supported yet; "
                        "use --tp (the drafter runs on the leader rank)")  # fmt: skip
    if args.disaggregation_mode != "null":
        raise ArgsError("--speculative-algorithm DFLASH with --disaggregation-mode is not "
                        "supported yet (the drafter's context would have to move too)")  # fmt: skip
    if args.enable_hierarchical_cache:
        raise ArgsError("--speculative-algorithm DFLASH with --enable-hierarchical-cache is "
                        "not supported yet (host pages lack the drafter's entries)")  # fmt: skip


def _block_size(args: ServerArgs) -> int | None:
    block, drafts = args.speculative_dflash_block_size, args.speculative_num_draft_tokens
    if block is not None and drafts is not None and block != drafts:
        raise ArgsError(f"--speculative-dflash-block-size {block} and "
                        f"--speculative-num-draft-tokens {drafts} differ; for DFLASH they must "
                        "match (the second is an alias of the first)")  # fmt: skip
    block = block if block is not None else drafts
    if block is not None and block < 2:
        flag = "dflash-block-size" if args.speculative_dflash_block_size else "num-draft-tokens"
        raise ArgsError(f"--speculative-{flag} {block}: DFLASH needs a block of at least 2 "
                        "(the last token and one draft)")  # fmt: skip
    return block


def _draft_path(args: ServerArgs) -> str:
    if args.speculative_draft_model_path:
        path = Path(args.speculative_draft_model_path)
        if not (path / "config.json").is_file():
            raise ArgsError(f"--speculative-draft-model-path {path}: no config.json there "
                            "(a local DFlash drafter folder; no model hub is reached)")  # fmt: skip
        return str(path)
    if Path(args.model_path).resolve() == default_model_path().resolve():
        return str(default_drafter_path())
    raise ArgsError("DFLASH speculative decoding requires setting "
                    "--speculative-draft-model-path (a DFlash / DFlash2 folder)")  # fmt: skip
