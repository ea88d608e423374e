"""The package is a house of floors that import only downward (docs/architecture.md).

The imports are read with `ast` (scripts/import_graph.py): every `import` and `from ... import`,
inside functions and under `TYPE_CHECKING` too, and the "module:attribute" strings registries
import lazily. No cycle anywhere (the package, bench/, scripts/, tests/); no import from a floor
to a higher one; every folder on a documented floor; the picture in docs/architecture.md is the
one the imports draw; every name imported from the package (or named by a registry string) is
one its module defines. Also: no source file over 400 lines, no test double in the package,
assets that hold only what the package loads at run time. (README's Layout, drawn from the tree
and the floors: tests/test_readme_layout.py.)
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import import_graph  # noqa: E402

MAX_LINES = 400
ASSETS = {  # what the package reads at run time
    "__init__.py", "console/index.html", "console/console.js", "console/console.css",
    "default_model/config.json", "default_model/generation_config.json",
    "default_model/model.safetensors", "default_model/tokenizer.json",
    "default_model/tokenizer_config.json", "default_model/chat_template.jinja",
    "default_dflash/config.json", "default_dflash/model.safetensors",
}  # fmt: skip


@pytest.fixture(scope="module")
def edges() -> list[import_graph.Edge]:
    return import_graph.edges()


def test_no_import_cycle(edges):
    assert import_graph.cycles(edges) == []


def test_imports_only_go_down_the_floors(edges):
    upward = [f"{e.source}:{e.line} -> {e.target}" for e in import_graph.upward(edges)]
    assert upward == [], "imports that run up a floor (pass the value down instead)"


def test_engine_rooms_import_only_downward(edges):
    """Inside engine/: kvcache/ < its top-level modules < ranks/ < decode/ < spec/ < engine.py
    (kvcache/ imports none of spec/, decode/, ranks/; a builder sits in the room it builds)."""
    upward = [f"{e.source}:{e.line} -> {e.target}" for e in import_graph.engine_upward(edges)]
    assert upward == []


def test_engine_modules_stay_small_and_few(edges):
    """No engine/ module imports more than 12 of the package's; at most 12 files at the top."""
    wide = {m: len(t) for m, t in import_graph.package_imports(edges).items()
            if m.startswith("dsaserve.engine") and len(t) > 12}  # fmt: skip
    assert wide == {}
    top = sorted(p.name for p in (ROOT / "dsaserve" / "engine").glob("*.py"))
    assert len(top) <= 12, top


def test_the_room_checker_sees_an_upward_import_inside_engine(tmp_path: Path):
    engine = tmp_path / "dsaserve" / "engine"
    (engine / "kvcache").mkdir(parents=True)
    (engine / "spec").mkdir()
    (engine / "kvcache" / "pool.py").write_text("from dsaserve.engine.spec import eagle\n")
    (engine / "spec" / "eagle.py").write_text("from dsaserve.engine import request\n")
    (engine / "request.py").write_text("from dsaserve.engine.kvcache import pool\n")
    found = import_graph.engine_upward(import_graph.edges(tmp_path))
    assert [(e.source, e.target) for e in found] == [
        ("dsaserve.engine.kvcache.pool", "dsaserve.engine.spec.eagle")
    ]


def test_every_module_is_on_a_documented_floor():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for module in import_graph.module_files():
        import_graph.floor(module)  # KeyError: a folder on no floor
    for floor, units in import_graph.FLOORS.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| {floor} |"))
        for unit in units:
            name = "dsaserve/__init__.py" if unit == "__init__" else unit
            assert f"`{name}" in row, f"floor {floor} of docs/architecture.md lacks {name}"


def _defined(path: Path) -> set[str]:
    """The names a module binds at its top level (under `if` and `try` too)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
                if "__all__" in names and isinstance(node.value, ast.List):  # a lazy __getattr__'s
                    names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body + node.orelse + getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return names


def test_every_imported_name_exists():
    """A moved or renamed module leaves no import behind that only fails when its line runs
    (a function-local import, a bench script no test imports, a registry string)."""
    files, missing = import_graph.module_files(), []
    packages = {n.rpartition(".")[0] for n in files}  # a folder without __init__.py too
    defined = functools.cache(lambda module: _defined(files[module]) if module in files else set())
    for source, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsaserve"):
                wanted = [(node.module, a.name) for a in node.names if a.name != "*"]
            elif isinstance(node, ast.Import):
                wanted = [(a.name, None) for a in node.names if a.name.startswith("dsaserve")]
            elif isinstance(node, ast.Constant) and import_graph.LAZY.match(str(node.value)):
                wanted = [tuple(node.value.split(":"))]
            else:
                continue
            for module, name in wanted:
                if module not in files and module not in packages:
                    missing.append(f"{source}:{node.lineno}: no module {module}")
                elif name and f"{module}.{name}" not in files and name not in defined(module):
                    missing.append(f"{source}:{node.lineno}: {module} has no {name}")
    assert missing == []


def test_the_documented_picture_is_drawn_from_the_imports(edges):
    assert import_graph.documented_picture() == import_graph.picture(edges), (
        "docs/architecture.md is stale: python scripts/import_graph.py --write"
    )


def test_the_checker_sees_lazy_and_by_name_imports(tmp_path: Path):
    """A lower floor reaching up inside a function, or by a registry's string, is caught, and
    so is the cycle the function-local import closes."""
    kernels, engine = tmp_path / "dsaserve" / "kernels", tmp_path / "dsaserve" / "engine"
    kernels.mkdir(parents=True)
    engine.mkdir()
    (kernels / "op.py").write_text("def f():\n    from dsaserve.engine import runner\n")
    (kernels / "table.py").write_text('IMPLS = {"x": "dsaserve.engine.runner:Runner"}\n')
    (engine / "runner.py").write_text("from dsaserve.kernels.op import f\n")
    found = import_graph.edges(tmp_path)
    assert import_graph.cycles(found) == [["dsaserve.engine.runner", "dsaserve.kernels.op"]]
    up = {(e.source, e.local, e.by_name) for e in import_graph.upward(found)}
    assert up == {("dsaserve.kernels.op", True, False), ("dsaserve.kernels.table", False, True)}


def test_no_source_file_over_400_lines():
    long = {}
    for top in ("dsaserve", "bench", "scripts", "tests"):
        for path in (ROOT / top).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                long[str(path.relative_to(ROOT))] = lines
    assert long == {}


def test_no_test_double_in_the_package():
    for path in (ROOT / "dsaserve").rglob("*.py"):
        text = path.read_text()
        assert "DSASERVE_TEST" not in text and "scripted" not in path.name, path


def test_assets_ship_only_what_runs():
    assets = ROOT / "dsaserve" / "assets"
    shipped = {str(p.relative_to(assets)) for p in assets.rglob("*") if p.is_file()}
    shipped = {name for name in shipped if "__pycache__" not in name}
    assert shipped == ASSETS
