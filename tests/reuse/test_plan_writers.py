"""A ``ReusePlan`` changes only through its own methods (``kvcomm/reuse/plan.py``): strategies
return a ``Serving`` instead of writing the plan, and the engine, the quality guard and the runner
call ``serve``, ``cut``, ``cut_trailing_text``, ``expect_new_bases``, ``ask_recompute`` and
``record_recompute``. Read from the source with ``ast`` (nothing imported): a write is an
assignment to, or an in-place change of, a ``ReusePlan`` field of a variable whose name holds
"plan" (``plan.note = ...``, ``plan.pieces.append(...)``, ``plan.pieces[-1] = ...``)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from test_layers import modules

from kvcomm.reuse.plan import ReusePlan

FIELDS = {f.name for f in dataclasses.fields(ReusePlan)}
IN_PLACE = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "setdefault"}
LEFT_TO_THE_SERVING_HALF = {"kvcomm.integrations.vllm.planning.server_planner"}
"""It sets a new plan's exact prefix and note after making it (issue 51's serving half, which
edits integrations/vllm, gives them to the constructor)."""


def _plan_field(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in FIELDS and isinstance(node.value, ast.Name)
            and "plan" in node.value.id.lower())


def plan_writes(path: Path) -> list[int]:
    """Lines of ``path`` that write a plan's fields."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in IN_PLACE:
            targets = [node.func.value]
        flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        if any(_plan_field(t.value if isinstance(t, ast.Subscript) else t) for t in flat):
            found.append(node.lineno)
    return found


def writers(known: dict[str, Path]) -> dict[str, list[int]]:
    """Module -> lines writing a plan, for every source module but ``kvcomm.reuse.plan``."""
    found = {name: plan_writes(path) for name, path in known.items() if name != "kvcomm.reuse.plan"}
    return {name: lines for name, lines in found.items() if lines}


def test_a_plan_changes_only_through_its_methods():
    found = writers(modules())
    assert set(found) == LEFT_TO_THE_SERVING_HALF, f"plan writers outside kvcomm/reuse/plan.py: {found}"


def test_a_write_is_caught(tmp_path):
    """The check itself: each kind of write, added to a strategy, is flagged."""
    known = modules()
    source = known["kvcomm.reuse.strategies.estimate"].read_text()
    for line in ("plan.note = 'x'", "plan.pieces.append(1)", "plan.pieces[-1] = 1", "a, plan.blend = 1, 2",
                 "reuse_plan.learn += [1]"):
        path = tmp_path / "module.py"
        path.write_text(source + f"\n\ndef later(plan, reuse_plan):\n    {line}\n")
        assert writers({**known, "kvcomm.reuse.strategies.estimate": path}).get("kvcomm.reuse.strategies.estimate"), line
