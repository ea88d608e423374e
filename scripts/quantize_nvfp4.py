"""Write a Model Optimizer NVFP4 checkpoint (routed experts in 4-bit) from an unquantised one.

    python scripts/quantize_nvfp4.py SRC DST [--twin TWIN]
    python scripts/quantize_nvfp4.py --random DST [--twin TWIN]   # from a tiny random model

--twin also writes the dequantised twin (float32 experts holding exactly the NVFP4 values).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from dsaserve.models.nvfp4 import quantize_checkpoint_nvfp4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?", help="unquantised checkpoint folder")
    parser.add_argument("dst", help="output folder for the NVFP4 checkpoint")
    parser.add_argument("--twin", help="also write the dequantised twin here")
    parser.add_argument("--random", action="store_true", help="quantise a tiny random model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.random == (args.src is not None):
        parser.error("give SRC or --random (not both)")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(args.src) if args.src else _random_model(Path(tmp) / "random", args.seed)
        quantize_checkpoint_nvfp4(src, args.dst, args.twin)
    print(f"wrote {args.dst}" + (f" and its dequantised twin {args.twin}" if args.twin else ""))
    return 0


def _random_model(folder: Path, seed: int) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_checkpoint  # the tests' tiny random GLM-5 family model

    return make_checkpoint(folder, "glm", seed=seed)


if __name__ == "__main__":
    raise SystemExit(main())
