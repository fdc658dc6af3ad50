"""Layers import only downward, packages import each other in no cycle, and files neither.

core < anchors < reuse < services < integrations < eval < cli: a module may import its own
layer or those below it. Inside a layer that holds several packages (the integrations), the
packages' import graph has no cycle; nor has the graph of modules (files), so each file can be
read knowing only what it imports. The vLLM plugin's folders are layers of their own: wire <
planning < connector < inprocess. Every import in the source counts, lazy ones inside
functions and ``TYPE_CHECKING`` ones included: each is a dependency. Read from the source
files with ``ast`` (nothing is imported), so the test also covers modules whose imports need
vLLM or AutoGen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"kvcomm": ROOT / "kvcomm", "kvcomm.anchors": ROOT / "anchors", "kvcomm.integrations": ROOT / "integrations",
           "kvcomm.eval": ROOT / "eval"}
"""Installed package name -> source folder (``pyproject.toml``'s ``package-dir``)."""

LAYERS = ("kvcomm.core", "kvcomm.anchors", "kvcomm.reuse", "kvcomm.services", "kvcomm.integrations", "kvcomm.eval", "kvcomm.cli")
"""Bottom to top."""

API = "kvcomm"
"""``kvcomm/__init__.py`` re-exports every layer's public names (lazily, by string): it is no layer."""


def modules() -> dict[str, Path]:
    """Every source module of the package, by dotted name."""
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if package == "kvcomm" and any(name == p or name.startswith(p + ".") for p in SOURCES if p != "kvcomm"):
                continue
            found[name] = path
    return found


def imports(path: Path, name: str) -> set[str]:
    """The ``kvcomm`` modules ``path`` (module ``name``) imports, relative imports resolved."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {m for m in found if m == "kvcomm" or m.startswith("kvcomm.")}


def layer_of(module: str) -> int | None:
    """Index in ``LAYERS`` of the layer holding ``module``; None for the API module itself."""
    for i in reversed(range(len(LAYERS))):
        if module == LAYERS[i] or module.startswith(LAYERS[i] + "."):
            return i
    return None


def package_of(module: str, known: dict[str, Path]) -> str:
    """The package a module belongs to: itself if it is one (an ``__init__``), else its parent."""
    path = known.get(module)
    return module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]


def upward_imports(known: dict[str, Path]) -> list[str]:
    found = []
    for name, path in sorted(known.items()):
        here = layer_of(name)
        if here is None:
            continue
        for target in sorted(imports(path, name)):
            there = layer_of(target)
            if there is not None and there > here:
                found.append(f"{name} ({LAYERS[here]}) imports {target} ({LAYERS[there]})")
    return found


def package_cycles(known: dict[str, Path]) -> list[list[str]]:
    """Cycles in the graph of packages (an edge: a module of one imports a module of another)."""
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        if layer_of(name) is None:
            continue
        source = package_of(name, known)
        for target in imports(path, name):
            if target not in known and target.rpartition(".")[0] in known:
                target = target.rpartition(".")[0]  # `from pkg.module import name`
            if target in known and layer_of(target) is not None:
                other = package_of(target, known)
                if other != source and not source.startswith(other + ".") and not other.startswith(source + "."):
                    edges.setdefault(source, set()).add(other)
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


def file_cycles(known: dict[str, Path]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (the strongly connected
    components of the module graph with more than one module), each sorted; an edge: a module
    imports another (``from pkg import module`` and ``from pkg.module import name`` alike)."""
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        for target in imports(path, name):
            if target not in known and target.rpartition(".")[0] in known:
                target = target.rpartition(".")[0]
            if target in known and target != name:
                edges.setdefault(name, set()).add(target)
    order, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(node: str) -> None:  # Tarjan's algorithm
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in order:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(known):
        if node not in order:
            connect(node)
    return groups


def with_import(tmp_path: Path, source: str, target: str) -> dict[str, Path]:
    """``modules()`` with ``source`` read from a copy given one more import, of ``target``."""
    known = modules()
    path = tmp_path / "module.py"
    path.write_text(known[source].read_text() + f"\nimport {target}\n")
    known[source] = path
    return known


def test_the_scan_sees_every_layer():
    known = modules()
    for layer in LAYERS:
        assert any(layer_of(m) == LAYERS.index(layer) for m in known), f"no module found in layer {layer}"
    assert "kvcomm.reuse.engine" in known and "kvcomm.integrations.vllm.connector" in known


def test_layers_import_only_downward():
    found = upward_imports(modules())
    assert not found, "upward imports:\n" + "\n".join(found)


def test_packages_import_each_other_in_no_cycle():
    found = package_cycles(modules())
    assert not found, "import cycles between packages:\n" + "\n".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("source, target, bad", [
    ("kvcomm.reuse.runner", "kvcomm.services.quality_guard", True),
    ("kvcomm.services.tenants", "kvcomm.reuse.engine", False),
    ("kvcomm.integrations.vllm.connector", "kvcomm.eval.report", True),
    ("kvcomm.eval.demo", "kvcomm.integrations.vllm.inprocess.llm", False),
])
def test_an_upward_import_is_caught(tmp_path, source, target, bad):
    """The checks themselves: a module given one more import is flagged exactly when it goes up."""
    known = with_import(tmp_path, source, target)
    assert any(f"{source} (" in line and f"imports {target} (" in line for line in upward_imports(known)) == bad


def test_a_cycle_between_packages_is_caught(tmp_path):
    known = with_import(tmp_path, "kvcomm.integrations.vllm.wire.config", "kvcomm.integrations.serve.command")
    assert any({"kvcomm.integrations.vllm.wire", "kvcomm.integrations.serve"} <= set(c) for c in package_cycles(known))


VLLM_ROLES = ("wire", "planning", "connector", "inprocess")
"""The vLLM plugin's folders, bottom to top (``integrations/vllm/__init__.py``)."""


def role_of(module: str) -> int | None:
    prefix = "kvcomm.integrations.vllm."
    role = module[len(prefix):].partition(".")[0] if module.startswith(prefix) else None
    return VLLM_ROLES.index(role) if role in VLLM_ROLES else None


def upward_role_imports(known: dict[str, Path]) -> list[str]:
    found = []
    for name, path in sorted(known.items()):
        here = role_of(name)
        for target in sorted(imports(path, name)) if here is not None else ():
            there = role_of(target)
            if there is not None and there > here:
                found.append(f"{name} ({VLLM_ROLES[here]}) imports {target} ({VLLM_ROLES[there]})")
    return found


def test_the_vllm_plugins_folders_import_only_downward():
    known = modules()
    assert all(any(role_of(m) == i for m in known) for i in range(len(VLLM_ROLES)))
    found = upward_role_imports(known)
    assert not found, "upward imports between the vLLM plugin's folders:\n" + "\n".join(found)


@pytest.mark.parametrize("source, target, bad", [
    ("kvcomm.integrations.vllm.planning.worker_plans", "kvcomm.integrations.vllm.connector.refusals", True),
    ("kvcomm.integrations.vllm.wire.params", "kvcomm.integrations.vllm.planning.guard", True),
    ("kvcomm.integrations.vllm.connector.worker", "kvcomm.integrations.vllm.planning.worker_plans", False),
])
def test_an_upward_import_between_the_vllm_folders_is_caught(tmp_path, source, target, bad):
    known = with_import(tmp_path, source, target)
    assert any(line.startswith(f"{source} (") and f"imports {target} (" in line
               for line in upward_role_imports(known)) == bad


def test_files_import_each_other_in_no_cycle():
    found = file_cycles(modules())
    assert not found, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("source, target, lazy", [
    ("kvcomm.anchors.distance", "kvcomm.anchors.pool", False),  # pool imports distance
    ("kvcomm.eval.metrics", "kvcomm.eval.outputs", True),  # closed through outputs -> summary -> metrics
])
def test_a_cycle_between_files_is_caught(tmp_path, source, target, lazy):
    """The check itself: one more import, at the top or inside a function, that closes a loop is flagged."""
    known = modules()
    assert not any(source in c for c in file_cycles(known))
    path = tmp_path / "module.py"
    added = f"\ndef later():\n    import {target}\n" if lazy else f"\nimport {target}\n"
    path.write_text(known[source].read_text() + added)
    known[source] = path
    assert any({source, target} <= set(c) for c in file_cycles(known))
