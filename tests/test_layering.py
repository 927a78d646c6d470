"""The layers point one way (DESIGN.md, "Layering"), checked by reading the source with ``ast``:

- ``kernels/`` imports neither ``memory/`` nor ``runtime/`` (it takes tensors and plain descriptors);
- ``memory/`` does not import ``runtime/``;
- no product module imports (or reaches through an imported module for) a ``_private`` name of another folder;
- the product modules have no import cycle (function-level imports count; ``if TYPE_CHECKING:`` ones do not);
- outside ``kernels/``, only ``runtime/runner.py`` builds step plans.

("No Triton" means an ``ImportError`` only: ``tests/test_kernels.py::test_triton_module_hides_only_import_errors``.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kernels": "multilora.kernels", "memory": "multilora.memory", "runtime": "multilora.runtime",
           "multilora": "multilora"}
FORBIDDEN = {"kernels": ("multilora.memory", "multilora.runtime"), "memory": ("multilora.runtime",)}


def _modules() -> dict[str, tuple[str, Path]]:
    """module name -> (folder, path) for every product source file."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = (folder, path)
    return out


MODULES = _modules()


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _folder_of(module: str) -> str | None:
    """The folder a module name lives in (longest package prefix)."""
    best = None
    for folder, package in FOLDERS.items():
        if (module == package or module.startswith(package + ".")) and (best is None or len(package) > len(FOLDERS[best])):
            best = folder
    return best


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                ids.update(id(n) for n in ast.walk(stmt))
    return ids


def _imports(module: str, path: Path):
    """(imported module, imported names or None, bound alias names, line, under TYPE_CHECKING) per import."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        tc = id(node) in typing_only
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, [a.asname or a.name.split(".")[0]], node.lineno, tc
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [a.name for a in node.names]
            yield base, names, [a.asname or a.name for a in node.names], node.lineno, tc


def _edges():
    """(importer, target module, line, typing-only, imported names, bound aliases) for imports of product modules."""
    for module, (folder, path) in MODULES.items():
        for base, names, aliases, line, tc in _imports(module, path):
            if not base.startswith("multilora"):
                continue
            targets = [(base, names, aliases)]
            if names is not None:  # "from pkg import submodule" imports the submodule
                subs = [(f"{base}.{n}", None, [a]) for n, a in zip(names, aliases) if f"{base}.{n}" in MODULES]
                rest = [(n, a) for n, a in zip(names, aliases) if f"{base}.{n}" not in MODULES]
                targets = subs + ([(base, [n for n, _ in rest], [a for _, a in rest])] if rest else [])
            for target, tnames, taliases in targets:
                yield module, target, line, tc, tnames, taliases


def test_every_product_file_is_seen():
    assert {"multilora.kernels.lora", "multilora.memory.pool", "multilora.runtime.runner", "multilora.config"} <= set(MODULES)


def test_layers_point_one_way():
    bad = []
    for importer, target, line, _, _, _ in _edges():
        folder = MODULES[importer][0]
        for forbidden in FORBIDDEN.get(folder, ()):
            if target == forbidden or target.startswith(forbidden + "."):
                bad.append(f"{_rel(MODULES[importer][1])}:{line} imports {target}")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_no_private_names_across_folders():
    bad = []
    for importer, target, line, _, names, aliases in _edges():
        folder, path = MODULES[importer]
        if _folder_of(target) == folder:
            continue
        for n in names or ():
            if n.startswith("_"):
                bad.append(f"{_rel(path)}:{line} imports {target}.{n}")
        if names is None and target in MODULES:  # a module of another folder: no reaching for its _names
            alias = aliases[0]
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == alias
                        and node.attr.startswith("_") and not node.attr.startswith("__")):
                    bad.append(f"{_rel(path)}:{node.lineno} uses {target}.{node.attr}")
    assert not bad, "private names used across folders:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for importer, target, _, tc, _, _ in _edges():
        if not tc and target in MODULES and target != importer:
            graph[importer].add(target)
    cycles, index, low, stack, on_stack, counter = [], {}, {}, [], set(), [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checks_catch_a_violation(tmp_path, monkeypatch):
    """The walker sees function-level imports, relative imports and reaching through a module alias."""
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from multilora.runtime import engine\n    from ..memory import pool\n"
                   "    import multilora.kernels.triton_sgmv as t\n    return t._chunk_table\n")
    found = list(_imports("multilora.kernels.x", src))
    assert ("multilora.runtime", ["engine"]) in [(b, n) for b, n, *_ in found]
    assert ("multilora.memory", ["pool"]) in [(b, n) for b, n, *_ in found]
    monkeypatch.setitem(MODULES, "multilora.runtime.fake_x", ("runtime", src))
    with pytest.raises(AssertionError, match="_chunk_table"):
        test_no_private_names_across_folders()
    monkeypatch.setitem(MODULES, "multilora.kernels.fake_x", ("kernels", src))
    with pytest.raises(AssertionError, match="imports multilora.runtime"):
        test_layers_point_one_way()


PLAN_BUILDERS = {"StepPlan", "LoRAPlan", "AttentionMetadata", "build_lora_plan", "build_attention_metadata",
                 "chunk_table", "fill_chunk_table", "tile_table"}


def test_step_plans_are_built_only_by_the_runner():
    """Outside ``kernels/`` (which defines the plan parts and their builders), only ``runtime/runner.py`` makes a
    plan or calls a plan builder: one home for the step plan."""
    bad = []
    for module, (folder, path) in MODULES.items():
        if folder == "kernels" or module == "multilora.runtime.runner":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
                if name in PLAN_BUILDERS:
                    bad.append(f"{_rel(path)}:{node.lineno} calls {name}")
    assert not bad, "plans built outside runtime/runner.py:\n" + "\n".join(bad)


def test_a_bare_kernels_import_from_the_checkout_gets_the_installed_package(tmp_path):
    """With the checkout's root first on sys.path (``python -c`` / ``python -m pytest`` run from it, Ray workers started
    from it), ``import kernels`` finds our ``kernels/`` folder first; it hands the name to the package of that name
    installed elsewhere (Hugging Face's, which transformers >= 5.25 imports), submodules included, and stays an empty
    module where there is none. ``multilora.kernels`` is unaffected either way."""
    import importlib.machinery
    import subprocess
    import sys

    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'hub'\n")
    (site / "kernels" / "layer.py").write_text("X = 1\n")
    code = ("import sys, kernels; from kernels import {names}; import multilora.kernels as mk; "
            "print(kernels.__file__, {names}, hasattr(mk, 'lora_apply'))")
    env_path = [str(ROOT)] + [p for p in sys.path if p and Path(p).resolve() != ROOT]
    installed = importlib.machinery.PathFinder.find_spec("kernels", env_path[1:])  # Hugging Face's, if installed
    for extra, names, want in (([str(site)], "CUDAProperties, layer", f"{site}/kernels/__init__.py hub"),
                               ([], "__name__", f"{installed.origin if installed else ROOT / 'kernels/__init__.py'} "
                                                f"kernels")):
        path = env_path[:1] + extra + env_path[1:]  # a stand-in package right after the root, before any installed one
        prog = f"import sys; sys.path[:] = {path!r}; " + code.format(names=names)
        p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-2000:]
        out = p.stdout.strip()
        assert out.startswith(want) and out.endswith("True"), out


def test_the_engine_config_imports_without_torch():
    """``multilora.runtime.config`` (``EngineConfig``, the CLI's flags and byte parser) loads neither torch nor the
    kernels: tools that only build or check a config stay light (torch alone takes about a second to import)."""
    import subprocess
    import sys

    code = ("import sys, multilora.runtime.config as c; c.EngineConfig(max_batch_size=2); c.parse_bytes('8GiB'); "
            "bad = [m for m in ('torch', 'triton', 'multilora.kernels', 'multilora.memory') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr or r.stdout
