"""The import graph of the repository, read with `ast`: cycles, imports that run up a floor, and
the picture of the package's floors that docs/architecture.md shows.

Every import counts: at module level, inside a function, under `if TYPE_CHECKING:`. The
"dsaserve.x.y:attr" strings a registry imports lazily count for the floors but not for cycles
(a seam's registry names its implementations, which import the seam: STYLE.md's registry with
lazy imports). The package's floors
are FLOORS (docs/architecture.md, DESIGN.md section 8): a module may import its own floor and
the floors below, never one above. bench/, scripts/ and tests/ stand above the package (they may
import any of it, the package none of them); they are read too, for cycles.

    python scripts/import_graph.py            # cycles, upward imports, the picture
    python scripts/import_graph.py --write    # rewrite the picture in docs/architecture.md
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("bench", "scripts", "tests")  # folders of scripts that put each other on sys.path
OUTSIDE = 9  # the floor of bench/, scripts/, tests/: above the package
# floor -> the package's folders and root modules on it (docs/architecture.md)
FLOORS = {
    1: (
        "args",
        "flags",
        "dflash_args",
        "sampling_params",
        "model_config",
        "process_tree",
        "grammar",
        "deploy",
        "cluster",
        "kernels",
        "assets",
        "web",
    ),
    2: ("distributed",),
    3: ("layers",),
    4: ("models",),
    5: ("engine",),
    6: ("runtime",),
    7: ("disaggregation", "llm"),
    8: ("server", "cli", "plan_cli", "bench", "__init__"),
}
FLOOR_OF = {unit: floor for floor, units in FLOORS.items() for unit in units}
# engine/'s rooms, bottom first, under the same rule inside engine/ (docs/architecture.md,
# "Inside engine/"): "core" is engine/'s top-level modules, "engine" its engine.py
ENGINE_ROOMS = {1: "kvcache", 2: "core", 3: "ranks", 4: "decode", 5: "spec", 6: "engine"}
ROOM_LEVEL = {name: level for level, name in ENGINE_ROOMS.items()}
LAZY = re.compile(r"^dsaserve(\.\w+)+:\w+$")  # "module:attribute", as the registries write
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- import-graph:begin -->", "<!-- import-graph:end -->"


@dataclass(frozen=True)
class Edge:
    source: str  # module name, e.g. dsaserve.engine.engine or bench.parallel
    target: str
    line: int
    local: bool  # inside a function (a lazy import)
    by_name: bool = False  # a registry's "module:attribute" string


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for the package and the tool folders."""
    files = {}
    for top in ("dsaserve", *TOOLS):
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def unit(module: str) -> str:
    """The folder or root module a package module belongs to (`__init__`: the package itself)."""
    parts = module.split(".")
    if parts[0] != "dsaserve":
        return parts[0]
    return parts[1] if len(parts) > 1 else "__init__"


def floor(module: str) -> int:
    if module.split(".")[0] != "dsaserve":
        return OUTSIDE
    if unit(module) not in FLOOR_OF:
        raise KeyError(f"{module}: its folder is on no floor (add it to FLOORS)")
    return FLOOR_OF[unit(module)]


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest known module `name` names (a package's attribute resolves to the package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _local_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            inside.update(id(sub) for sub in ast.walk(node) if sub is not node)
    return inside


def _is_lazy(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and bool(LAZY.match(node.value))
    )


def _names(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement or a lazy-import string refers to."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        return [f"{base}.{alias.name}" for alias in node.names]
    if _is_lazy(node):
        return [node.value.partition(":")[0]]
    return []


def _targets(name: str, source: str, modules: set[str]) -> str | None:
    if name.split(".")[0] == "dsaserve":
        return _resolve(name, modules)
    if source.split(".")[0] == "dsaserve":
        return None  # a third-party package
    here = source.split(".")[0]  # a tool script: its own folder first, then the others
    for top in (here, *TOOLS):
        found = _resolve(f"{top}.{name}", modules)
        if found is not None and found != top:
            return found
    return None


def edges(root: Path = ROOT) -> list[Edge]:
    files = module_files(root)
    modules = set(files)
    found = set()
    for source, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        local = _local_nodes(tree)
        for node in ast.walk(tree):
            for name in _names(node, package):
                target = _targets(name, source, modules)
                if target is not None and target != source:
                    local_one = id(node) in local
                    found.add(Edge(source, target, node.lineno, local_one, _is_lazy(node)))
    return sorted(found, key=lambda e: (e.source, e.line, e.target))


def cycles(found: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    graph = defaultdict(set)
    for e in found:
        if not e.by_name:
            graph[e.source].add(e.target)
    index, low, on_stack, stack, result = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        result.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(result)


def upward(found: list[Edge]) -> list[Edge]:
    """Imports from a floor to a higher one (the package importing a tool script included)."""
    return [e for e in found if floor(e.target) > floor(e.source)]


def room(module: str) -> str | None:
    """The room of engine/ a module is in (None: not in engine/)."""
    parts = module.split(".")
    if parts[:2] != ["dsaserve", "engine"] or len(parts) < 3:
        return None
    if parts[2] in ROOM_LEVEL and parts[2] not in ("core", "engine"):
        return parts[2]
    return "engine" if parts[2] == "engine" else "core"


def engine_upward(found: list[Edge]) -> list[Edge]:
    """Imports inside engine/ from a room to a higher one."""
    return [
        e for e in found
        if room(e.source) and room(e.target)
        and ROOM_LEVEL[room(e.target)] > ROOM_LEVEL[room(e.source)]
    ]  # fmt: skip


def package_imports(found: list[Edge]) -> dict[str, set[str]]:
    """Package module -> the other package modules it imports."""
    out = defaultdict(set)
    for e in found:
        if e.source.startswith("dsaserve") and e.target.startswith("dsaserve"):
            out[e.source].add(e.target)
    return out


def unit_graph(found: list[Edge]) -> dict[str, set[str]]:
    """Package unit -> the other package units it imports."""
    graph = defaultdict(set)
    for e in found:
        if e.source.startswith("dsaserve") and e.target.startswith("dsaserve"):
            if unit(e.source) != unit(e.target):
                graph[unit(e.source)].add(unit(e.target))
    return graph


def _label(name: str) -> str:
    if name == "__init__":
        return "dsaserve/__init__.py"
    return name + ("/" if (ROOT / "dsaserve" / name).is_dir() else ".py")


def picture(found: list[Edge]) -> str:
    """Each floor, top first, and under it each of its units with the units it imports, grouped
    by their floor (`5 engine/`: engine/ is on floor 5)."""
    graph = unit_graph(found)
    lines = []
    for level in sorted(FLOORS, reverse=True):
        lines.append(f"floor {level}: " + "  ".join(_label(u) for u in FLOORS[level]))
        for name in FLOORS[level]:
            by_floor = defaultdict(list)
            for target in graph.get(name, ()):
                by_floor[FLOOR_OF[target]].append(_label(target))
            groups = [
                f"{f} " + " ".join(sorted(by_floor[f])) for f in sorted(by_floor, reverse=True)
            ]
            lines.append(f"    {_label(name):<22} -> " + (" | ".join(groups) or "(nothing)"))
    return "\n".join(lines + _rooms_picture(found)) + "\n"


def _room_label(name: str) -> str:
    return {"core": "engine/*.py", "engine": "engine/engine.py"}.get(name, f"engine/{name}/")


def _rooms_picture(found: list[Edge]) -> list[str]:
    """engine/'s rooms, top first, each with the rooms it imports."""
    graph = defaultdict(set)
    for e in found:
        if room(e.source) and room(e.target) and room(e.source) != room(e.target):
            graph[room(e.source)].add(room(e.target))
    lines = ["", "inside engine/, room by room:"]
    for level in sorted(ENGINE_ROOMS, reverse=True):
        name = ENGINE_ROOMS[level]
        below = sorted(graph.get(name, ()), key=lambda r: -ROOM_LEVEL[r])
        targets = " | ".join(f"{ROOM_LEVEL[r]} {_room_label(r)}" for r in below)
        lines.append(f"    {level} {_room_label(name):<19} -> {targets or '(nothing)'}")
    return lines


def documented_picture() -> str | None:
    text = DOC.read_text() if DOC.exists() else ""
    if BEGIN not in text or END not in text:
        return None
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return block.strip().removeprefix("```").removesuffix("```").strip("\n") + "\n"


def write_picture(drawn: str) -> None:
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{BEGIN}\n```\n{drawn}```\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/architecture.md's")
    ns = parser.parse_args(argv)
    found = edges()
    loops, up = cycles(found), upward(found)
    print(f"{len(module_files())} modules, {len(found)} imports")
    print(f"cycles: {len(loops)}")
    for loop in loops:
        print("  " + " <-> ".join(loop))
    print(f"upward imports: {len(up)}")
    for e in up:
        where = " (by name)" if e.by_name else " (in a function)" if e.local else ""
        print(f"  {floor(e.source)} -> {floor(e.target)}  {e.source}:{e.line} -> {e.target}{where}")
    drawn = picture(found)
    print("\n" + drawn)
    if ns.write:
        write_picture(drawn)
    return 1 if loops or up else 0


if __name__ == "__main__":
    sys.exit(main())
