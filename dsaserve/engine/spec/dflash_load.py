"""`--speculative-algorithm DFLASH`'s start-up: the drafter loaded and checked against the
target, its block size, and its step decoder (dflash.py)."""

from __future__ import annotations

import logging

import torch

from dsaserve.args import ArgsError
from dsaserve.dflash_args import DFlashSettings
from dsaserve.engine.decode.runner import ModelRunner
from dsaserve.engine.spec.dflash import DFlashDecoder
from dsaserve.engine.spec.draft import DraftContext, Drafter
from dsaserve.kernels.registry import Kernels
from dsaserve.model_config import ConfigError, ModelConfig
from dsaserve.models.checkpoint_files import CheckpointError
from dsaserve.models.dflash import DFlashDraftModel
from dsaserve.models.dflash_loader import load_drafter

logger = logging.getLogger(__name__)


def load_dflash(settings: DFlashSettings, target: ModelConfig, dtype: torch.dtype,
                device: torch.device) -> DFlashDraftModel:  # fmt: skip
    """The drafter, fitted to the target; a misfit or unreadable folder as one-line ArgsError."""
    try:
        drafter = load_drafter(settings.draft_path, target, dtype, device)
    except (ConfigError, CheckpointError) as e:
        raise ArgsError(str(e)) from None
    config = drafter.config
    logger.info("DFlash drafter %s: %s, %d layers, block size %d (%s), target layers %s",
                settings.draft_path, config.architecture, config.num_layers,
                config.verify_block(settings.block_size),
                "flag" if settings.block_size else "checkpoint",
                list(config.target_layer_ids))  # fmt: skip
    return drafter


def build_decoder(runner: ModelRunner, drafter: DFlashDraftModel, kernels: Kernels,
                  num_slots: int, settings: DFlashSettings,
                  native: bool = True) -> DFlashDecoder:  # fmt: skip
    """The DFLASH step; `native` (no --disable-native-decode): the drafter's C++ form on CPU."""
    device = runner.device
    dtype = drafter.fc.weight.dtype
    context = DraftContext(drafter, num_slots, dtype, device)
    block = drafter.config.verify_block(settings.block_size)
    proposer = Drafter(drafter, runner.model, context, kernels, block, settings.window, native)
    return DFlashDecoder(runner, proposer, drafter.config.target_layer_ids)
