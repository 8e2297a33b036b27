"""The package's layers: one folder per layer, lower never imports higher, no import cycles.

The graph is read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` of the package, at the top of a module and inside functions alike. A command
module that ``cli/app.py`` loads by name (``importlib``) is not an edge: the graph holds what the
source names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "voodoo_quant"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

# Lowest first: a module may import its own layer and those before it, never one after it.
LAYERS = (
    "core",         # errors, envs, faults, fileio, paths, units, the ggml type table and bridge
    "gguf",         # llama.cpp's converter, the GGUF header reader, the HF -> GGUF layout, stock recipes, imatrix
    "selection",    # menus, budget, assignment
    "quants",       # torch dequant kernels, bit-exact with ggml
    "candidates",   # cache, precache, compact, mixkernel, compensate (+ compensation_walk), hessian_store
    "hardware",     # CUDA / ROCm / CPU detection, env defaults, attention backend
    "model",        # loading models (modeling, lazyload, checkpoints), lm_head
    "distributed",  # parallel, tp_checkpoint, device_map
    "arch",         # architecture adapters
    "student",      # the gated student: build, layers
    "training",     # the trainer and everything it runs
    "memory",       # the memory model of a run (adds up training's sizes)
    "tools",        # one module per pipeline step
    "cli",          # the Typer app
)
# Folders on the level of another: experimental/ holds the trainer's options measured no better than
# the default (routing, the relaxation gap, the measured sensitivity and search); the trainer switches
# them on, and they use its parts, so they are one layer with training, set apart in a folder.
SAME_LEVEL = {"experimental": "training"}
# Modules at the package root, above every layer: the lazy package facade and the Python API.
ROOT_MODULES = ("__init__", "api")


def modules(pkg_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its __init__)."""
    out = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = [pkg_dir.name, *path.relative_to(pkg_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(pkg_dir: Path = PACKAGE_DIR) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}."""
    mods = modules(pkg_dir)
    root = pkg_dir.name
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges = graph.setdefault(name, {})
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
            for target in targets:
                if target != root and not target.startswith(root + "."):
                    continue
                while target not in mods:  # `import voodoo_quant.x.y` of a name inside a module
                    target = target.rpartition(".")[0]
                if target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def layer_of(module: str) -> int:
    """Index in LAYERS (len(LAYERS) for a root module); a module in no known layer is an error."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] in ROOT_MODULES):
        return len(LAYERS)
    folder = SAME_LEVEL.get(parts[1], parts[1])
    if folder not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add its folder to LAYERS in {Path(__file__).name}")
    return LAYERS.index(folder)


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    return [f"{src} (layer {LAYERS[layer_of(src)] if layer_of(src) < len(LAYERS) else 'root'}) imports "
            f"{dst} (layer {LAYERS[layer_of(dst)] if layer_of(dst) < len(LAYERS) else 'root'}), line {line}"
            for src, edges in sorted(graph.items()) for dst, line in sorted(edges.items())
            if layer_of(dst) > layer_of(src)]


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def root_modules(pkg_dir: Path = PACKAGE_DIR) -> list[str]:
    return sorted(p.stem for p in pkg_dir.glob("*.py"))


def folders(pkg_dir: Path = PACKAGE_DIR) -> list[str]:
    return sorted(p.name for p in pkg_dir.iterdir() if p.is_dir() and (p / "__init__.py").is_file())


# -- the package -----------------------------------------------------------------------------------
def test_every_folder_is_a_layer_and_the_root_holds_only_the_entry_points():
    assert set(folders()) == set(LAYERS) | set(SAME_LEVEL), "a folder of the package must take its place in LAYERS (and only folders are layers)"
    extra = [m for m in root_modules() if m not in ROOT_MODULES]
    assert not extra, f"modules at the package root that belong in a layer's folder: {extra}"


def test_no_module_imports_a_higher_layer():
    bad = upward_imports(import_graph())
    assert not bad, "imports from a lower layer into a higher one:\n  " + "\n  ".join(bad)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_imports_inside_functions_too():
    graph = import_graph()
    assert "voodoo_quant.tools.export" in graph["voodoo_quant.cli.export"]  # imported inside the command
    assert "voodoo_quant.core.errors" in graph["voodoo_quant.core.fileio"]  # at the top


# -- the checks themselves, on a package made to break them -----------------------------------------
def test_the_checks_name_an_upward_import_a_cycle_and_a_stray_root_module(tmp_path):
    pkg = tmp_path / PACKAGE
    for folder in ("core", "training"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "stray.py").write_text("")
    (pkg / "core" / "errors.py").write_text("def f():\n    from ..training import trainer\n")
    (pkg / "training" / "trainer.py").write_text("from . import journal\n")
    (pkg / "training" / "journal.py").write_text("import voodoo_quant.training.trainer\n")
    graph = import_graph(pkg)
    assert upward_imports(graph) == [
        "voodoo_quant.core.errors (layer core) imports voodoo_quant.training.trainer (layer training), line 2"]
    assert find_cycle(graph) == ["voodoo_quant.training.trainer", "voodoo_quant.training.journal",
                                 "voodoo_quant.training.trainer"]
    assert [m for m in root_modules(pkg) if m not in ROOT_MODULES] == ["stray"]


# -- what start-up loads --------------------------------------------------------------------------
@pytest.mark.parametrize("code", [
    "import typer, voodoo_quant.cli.app as a; typer.main.get_command(a.app)",  # what `voodoo --help` builds
    "import voodoo_quant.api",
])
def test_start_up_loads_no_torch_numpy_or_transformers(code):
    # a fresh interpreter: the test process has torch loaded already
    probe = f"{code}\nimport sys\nprint(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"{code!r} loads {out.strip()}: import it inside the function that needs it"
