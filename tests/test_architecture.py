"""The package's shape: imports flow one way through the layers the subpackages'
docstrings name, without cycles; importing the library changes nothing in the process.
A module is as long as its idea: there is no line cap.

    python -m pytest -q tests/test_architecture.py     # also prints the import graph summary
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edm2_jax"



def _layers_of_the_docs() -> tuple[tuple[str, ...], ...]:
    """The layers, lowest first, as docs/architecture.md's table "Package layout by role"
    lists them (the one list of them): each row's backticked files and folders as module
    names (`model/` -> edm2_jax.model, `paths.py` -> edm2_jax.paths); the last row also
    holds the package itself (`edm2_jax/__init__.py`)."""
    rows = []
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        m = re.fullmatch(r"\| (\d+) \| (.*?) \| .* \|", line)
        if m:
            names = re.findall(r"`([a-z_]+)(?:/|\.py)`", m.group(2))
            rows.append((int(m.group(1)), tuple(f"edm2_jax.{n}" for n in names)))
    assert [i for i, _ in rows] == list(range(len(rows))), "the table's layers are not 0, 1, ..."
    layers = [names for _, names in rows]
    layers[-1] += ("edm2_jax",)
    return tuple(layers)


# Lowest first. A module may import modules of its own layer or of a lower one. The
# first prefix that matches a module name gives its layer.
LAYERS = _layers_of_the_docs()


def _modules() -> dict[str, Path]:
    mods = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def _is_main_block(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":`, the code a module runs as a process's entry point
    (`python -m MODULE`) and never on import: it stands at the top layer, with main."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__"
                    for c in node.test.comparators))


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (at any depth of its code but its
    `__main__` block)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        tree.body = [n for n in tree.body if not _is_main_block(n)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def _layer(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of docs/architecture.md's table")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_imports_flow_down_without_cycles():
    mods = _modules()
    edges = _imports(mods)
    upward = sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs
                    if _layer(b) > _layer(a))
    cycles = _cycles(edges)
    print(f"\n{len(mods)} modules, {sum(map(len, edges.values()))} imports, "
          f"{len(cycles)} cycles, {len(upward)} upward imports")
    assert not cycles, f"import cycles: {cycles}"
    assert not upward, "imports from a lower layer up to a higher one:\n" + "\n".join(upward)


def _environment_unchanged_by(before: str, imports: str) -> None:
    """Run `before`, snapshot os.environ, run `imports`: the environment must be equal."""
    code = (f"import os; {before}; e = dict(os.environ); {imports}; "
            "assert dict(os.environ) == e, sorted(set(os.environ.items()) ^ set(e.items()))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.ci  # ~10 s or more on 2 cores: CI runs it after the quick suite
def test_importing_the_library_changes_no_environment_variable():
    # The package and the model, from a bare interpreter.
    _environment_unchanged_by("pass", "import edm2_jax, edm2_jax.model")
    # Modules that import jax, compared after `import jax`, which sets variables of its
    # own (TPU_SKIP_MDS_QUERY, TF_CPP_MIN_LOG_LEVEL).
    _environment_unchanged_by(
        "import jax", "import edm2_jax, edm2_jax.model, edm2_jax.model.networks, "
        "edm2_jax.training.loop, edm2_jax.sampling.sampler, edm2_jax.ema.reconstruction, "
        "edm2_jax.backends")


def test_every_subpackage_states_its_role_and_has_a_layer():
    """Each subpackage's docstring says its role; its layer (what it may import) is its
    row of docs/architecture.md's table, the one list of the layers."""
    listed = {p for layer in LAYERS for p in layer}
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.splitlines()) >= 2, (
            f"{init.relative_to(ROOT)}: its docstring should say the subpackage's role")
        assert f"edm2_jax.{init.parent.name}" in listed, (
            f"{init.parent.name}/ has no row in docs/architecture.md's layer table")
