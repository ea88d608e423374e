"""The transfer-engine seam: one small interface, NIXL and Mooncake behind it (lazy imports)."""

from __future__ import annotations

from dsaserve.disaggregation.transfer.base import TransferEngine, TransferError, create

__all__ = ["TransferEngine", "TransferError", "create"]
