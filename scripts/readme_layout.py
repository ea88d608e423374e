"""README.md's Layout block, generated from the tree and the package's floors
(scripts/import_graph.py's FLOORS), so the list a newcomer reads cannot drift from the files.
tests/test_readme_layout.py fails when README.md's block differs from what this draws.

The package first, top floor first, the floor number beside its first folder; each folder's
files by name (source: .py .cpp .h .sh .js .css .html .md, and scripts without a suffix;
`__init__.py` left out, every package has one), then each sub-folder that holds code as its own
entry, named by its path (`server/openai/`, `engine/kvcache/hicache/`: any depth). A folder
without code (the checkpoint in assets/, bench/results/, docs/images/) is named in its parent's
list, not opened: its data files change without the layout changing. Then the folders beside
the package: tests/ (as patterns, `test_*.py` and its helpers' `*.py`: a hundred names would
not fit README.md's 12 KB), bench/, scripts/, .ci/ and docs/.

    python scripts/readme_layout.py            # exit 1 and print a diff when README.md is stale
    python scripts/readme_layout.py --write    # rewrite the block between the markers
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from import_graph import FLOORS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- readme-layout:begin -->", "<!-- readme-layout:end -->"
WIDTH = 100
INDENT = " " * 5  # where a wrapped entry's next line starts
CODE = {".py", ".cpp", ".h", ".sh", ".js", ".css", ".html", ""}  # "": a script such as .ci/run
LISTED = CODE | {".md"}
TOP = ("tests", "bench", "scripts", ".ci", "docs")  # beside the package, in this order
PATTERNS = {"tests": ("test_*.py", "*.py")}  # files a top folder lists as patterns
SKIPPED = ("__pycache__", "*.egg-info", "*.pyc", ".*")
Tree = dict[str, "Tree | None"]


def files(root: Path) -> list[Path]:
    """The files under root, relative: git's view where root is a checkout (tracked files and
    new ones, none it ignores), else every file."""
    if not (root / ".git").exists():
        return [p.relative_to(root) for p in root.rglob("*") if p.is_file()]
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [Path(name) for name in listed.stdout.split("\0") if name and (root / name).is_file()]


def tree(paths: list[Path]) -> Tree:
    """Nested dicts, name -> sub-tree (a folder) or None (a file), without caches and hidden
    names below the top."""
    top: Tree = {}
    for path in paths:
        if any(fnmatch.fnmatch(part, s) for part in path.parts[1:] for s in SKIPPED):
            continue
        node = top
        for part in path.parts[:-1]:
            node = node.setdefault(part, {})
        node[path.name] = None
    return top


def _holds_code(folder: Tree) -> bool:
    return any(
        Path(name).suffix in CODE if sub is None else _holds_code(sub)
        for name, sub in folder.items()
    )  # fmt: skip


def _names(folder: Tree, patterns: tuple[str, ...] = ()) -> list[str]:
    """A folder's own line: its listed files, then the folders it does not open."""
    files = sorted(n for n, sub in folder.items() if sub is None and Path(n).suffix in LISTED)
    files = [n for n in files if n != "__init__.py"]
    shown = [p for p in patterns if any(fnmatch.fnmatch(n, p) for n in files)]
    files = [n for n in files if not any(fnmatch.fnmatch(n, p) for p in patterns)]
    data = sorted(f"{n}/" for n, sub in folder.items() if sub is not None and not _holds_code(sub))
    return shown + files + data


def entries(folder: Tree, label: str, patterns: tuple[str, ...] = ()) -> list[list[str]]:
    """`[label, names...]` for the folder, then the same for each sub-folder with code, depth
    first, each labelled with its path from the folder's parent."""
    found = [[label, *_names(folder, patterns)]]
    for name, sub in sorted(folder.items()):
        if sub is not None and _holds_code(sub):
            found += entries(sub, f"{label}{name}/")
    return found


def _wrap(prefix: str, words: list[str]) -> list[str]:
    return textwrap.wrap(
        " ".join(words), WIDTH, initial_indent=prefix, subsequent_indent=INDENT,
        break_long_words=False, break_on_hyphens=False,
    )  # fmt: skip


def _check_floors(package: Tree, floors: dict[int, tuple[str, ...]]) -> None:
    """A folder or root module on no floor would be left out of the block: refuse instead."""
    units = {unit for on_floor in floors.values() for unit in on_floor}
    for name, sub in package.items():
        if (sub is not None or name.endswith(".py")) and name.removesuffix(".py") not in units:
            raise SystemExit(f"dsaserve/{name} is on no floor: add it to import_graph.FLOORS")


def package_lines(package: Tree, floors: dict[int, tuple[str, ...]]) -> list[str]:
    """dsaserve/, top floor first: each floor's folders (with their nested entries), then its
    root modules as one entry, the floor's number on its first line."""
    _check_floors(package, floors)
    lines = ["dsaserve/"]
    for floor in sorted(floors, reverse=True):
        units = [u for u in floors[floor] if u != "__init__"]
        found = [
            e for u in units if package.get(u) is not None for e in entries(package[u], f"{u}/")
        ]
        modules = [f"{u}.py" for u in units if f"{u}.py" in package]
        for i, words in enumerate(found + ([modules] if modules else [])):
            lines += _wrap(f"{floor:2d} " if i == 0 else "   ", words)
    return lines


def block(root: Path = ROOT, floors: dict[int, tuple[str, ...]] = FLOORS) -> str:
    """The fenced block README.md's Layout shows."""
    top = tree(files(root))
    lines = package_lines(top.get("dsaserve", {}), floors)
    for name in (t for t in TOP if top.get(t) is not None):
        for words in entries(top[name], f"{name}/", PATTERNS.get(name, ())):
            lines += _wrap("", words)
    return "```\n" + "\n".join(lines) + "\n```\n"


def documented(readme: Path = README) -> str:
    """The block between the markers in README.md ('' when the markers are missing)."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        return ""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].lstrip("\n")


def write(drawn: str, readme: Path = README) -> None:
    head, rest = readme.read_text().split(BEGIN, 1)
    readme.write_text(f"{head}{BEGIN}\n{drawn}{END}{rest.split(END, 1)[1]}")


def diff(drawn: str, readme: Path = README) -> str:
    """What --write would change, as a unified diff ('' when README.md is current)."""
    lines = difflib.unified_diff(
        documented(readme).splitlines(keepends=True), drawn.splitlines(keepends=True),
        "README.md (Layout)", "scripts/readme_layout.py",
    )  # fmt: skip
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md's Layout block")
    ns = parser.parse_args(argv)
    drawn = block()
    if ns.write:
        write(drawn)
        return 0
    stale = diff(drawn)
    if stale:
        print(stale + "\nREADME.md's Layout is stale: python scripts/readme_layout.py --write")
        return 1
    print("README.md's Layout is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
