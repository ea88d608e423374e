"""README.md's Layout block is the one scripts/readme_layout.py draws from the tree and the
floors, so a file added, moved or removed shows up as a stale README here, and the generator
covers what the block must: nested folders at any depth, .cpp and .h files, folders of data
named but not opened, bench/ and scripts/ beside the package, a folder on no floor refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import readme_layout  # noqa: E402


def test_readme_layout_is_the_generated_one():
    assert readme_layout.diff(readme_layout.block()) == "", (
        "README.md's Layout is stale: python scripts/readme_layout.py --write"
    )


def _tree(root: Path, files: list[str]) -> None:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")


FLOORS = {1: ("args", "kernels", "assets"), 5: ("engine",), 8: ("__init__",)}


def test_the_generator_sees_nested_folders_headers_and_tools(tmp_path: Path):
    _tree(tmp_path, [
        "dsaserve/__init__.py", "dsaserve/args.py",
        "dsaserve/kernels/__init__.py", "dsaserve/kernels/op.cpp", "dsaserve/kernels/op_math.h",
        "dsaserve/kernels/__pycache__/op.cpython-312.pyc",
        "dsaserve/engine/engine.py", "dsaserve/engine/kvcache/pool.py",
        "dsaserve/engine/kvcache/hicache/moves.py",
        "dsaserve/assets/model/config.json", "dsaserve/assets/console/console.js",
        "bench/decode.py", "bench/results/run.json", "scripts/tool.py", "tests/test_a.py",
        "tests/harness.py",
    ])  # fmt: skip
    lines = readme_layout.block(tmp_path, FLOORS).splitlines()
    assert lines == [
        "```",
        "dsaserve/",
        " 5 engine/ engine.py",
        "   engine/kvcache/ pool.py",
        "   engine/kvcache/hicache/ moves.py",
        " 1 kernels/ op.cpp op_math.h",
        "   assets/ model/",
        "   assets/console/ console.js",
        "   args.py",
        "tests/ test_*.py *.py",
        "bench/ decode.py results/",
        "scripts/ tool.py",
        "```",
    ]


def test_a_folder_on_no_floor_is_refused(tmp_path: Path):
    _tree(tmp_path, ["dsaserve/args.py", "dsaserve/newpart/x.py"])
    with pytest.raises(SystemExit, match="newpart is on no floor"):
        readme_layout.block(tmp_path, FLOORS)


def test_write_puts_the_block_between_the_markers(tmp_path: Path):
    _tree(tmp_path, ["dsaserve/args.py"])
    readme = tmp_path / "README.md"
    stale = f"# x\n\n{readme_layout.BEGIN}\n```\nold\n```\n{readme_layout.END}\n\n## After\n"
    readme.write_text(stale)
    drawn = readme_layout.block(tmp_path, FLOORS)
    assert "+ 1 args.py" in readme_layout.diff(drawn, readme)
    readme_layout.write(drawn, readme)
    assert readme_layout.diff(drawn, readme) == ""
    assert readme.read_text().endswith(f"{readme_layout.END}\n\n## After\n")
