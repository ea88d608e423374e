"""Target hidden states a speculative drafter reads: the outputs of chosen layers (taps)."""

from __future__ import annotations

import torch


def join_taps(final: torch.Tensor, outputs: dict[int, torch.Tensor], taps: tuple[int, ...],
              last: int) -> torch.Tensor:  # fmt: skip
    """[final ‖ outputs[i] for i in taps]: layer i's output, except that the last layer's tap is
    `final` (after model.norm), as transformers' `hidden_states[-1]` is (what DFlash drafters
    are trained on)."""
    if not taps:
        return final
    return torch.cat([final, *(final if i == last else outputs[i] for i in taps)], dim=-1)
