"""Convert a bf16/fp32 checkpoint folder into a DeepSeek-style block-FP8 one.

Usage: python scripts/quantize_fp8.py SRC DST [--block 128]
"""

from __future__ import annotations

import argparse
import sys

from dsaserve.models.checkpoint_files import CheckpointError
from dsaserve.models.fp8 import quantize_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="checkpoint folder to read (bf16/fp16/fp32 safetensors)")
    parser.add_argument("dst", help="new folder to write (must not exist or be empty)")
    parser.add_argument("--block", type=int, default=128, help="square block size (default 128)")
    args = parser.parse_args(argv)
    if args.block <= 0:
        parser.error("--block must be positive")
    try:
        quantize_checkpoint(args.src, args.dst, block=args.block)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote block-FP8 checkpoint to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
