"""A workload: a pipeline, the gold reference of each input row and a scorer (``Workload``),
the error every workload problem raises, and KVCOMM's default topology the built-in workloads
(``kvcomm.eval.workloads``) and the JSONL files (``kvcomm.eval.workload_files``) run."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from kvcomm.reuse.pipeline import PipelineSpec, parse_pipeline

DEFAULT_MAX_NEW_TOKENS: Mapping[str, int] = MappingProxyType(
    {"mmlu": 96, "gsm": 128, "humaneval": 256, "retrieval": 32, "file": 96})
MAX_AGENTS = 16
GENERIC_ROLES = ("a knowledgeable expert", "a careful reasoner", "a critical reviewer",
                 "a fact checker", "a patient teacher", "a skeptical analyst")

Scorer = Callable[[str, object], float]


class WorkloadError(ValueError):
    """A workload that cannot be loaded or scored; the message names the workload or file and the fix."""


@dataclass(frozen=True)
class Workload:
    """A pipeline to run, the gold reference of each input row, and how to score the final reply.

    Invariants: ``len(references) == len(pipeline.inputs)``; ``details`` and ``row_scorers`` are
    empty or have one entry per row.  ``details[i]`` holds row metadata (MMLU ``subject``,
    retrieval ``depth``, HumanEval ``task_id``, ``source_index`` in the source data, ...).
    ``row_scorers[i]``, when given and not None, overrides ``scorer`` for row ``i`` (JSONL rows
    with their own ``"scorer"``).  A reference of None means the row has no gold answer.
    """
    name: str
    pipeline: PipelineSpec
    references: tuple[object, ...]
    scorer: Scorer
    details: tuple[Mapping[str, object], ...] = ()
    row_scorers: tuple[Scorer | None, ...] = ()

    def __post_init__(self) -> None:
        for field in ("references", "details", "row_scorers"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        n = len(self.pipeline.inputs)
        if len(self.references) != n:
            raise WorkloadError(f"workload {self.name!r}: {len(self.references)} references for {n} input rows")
        for field in ("details", "row_scorers"):
            if getattr(self, field) and len(getattr(self, field)) != n:
                raise WorkloadError(f"workload {self.name!r}: {field} must be empty or have one entry per row ({n})")

    def __len__(self) -> int:
        return len(self.pipeline.inputs)

    @property
    def decider(self) -> str:
        """Name of the agent whose reply is scored (the last one)."""
        return self.pipeline.agents[-1].name

    def score(self, row: int, reply: str) -> float:
        """Score of the final agent's ``reply`` on input row ``row``, in ``[0, 1]``."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(self):
            raise WorkloadError(f"workload {self.name!r}: row {row!r} out of range 0..{len(self) - 1}")
        ref = self.references[row]
        if ref is None:
            raise WorkloadError(f"workload {self.name!r}: row {row} has no reference; add \"references\" "
                                f"(pipeline JSON) or \"answer\" (JSONL) to the file")
        scorer = (self.row_scorers[row] if self.row_scorers else None) or self.scorer
        return min(1.0, max(0.0, float(scorer(reply, ref))))


def default_pipeline(
    tasks: Sequence[str], *, n_agents: int = 3, agent_instruction: str, decider_instruction: str,
    max_new_tokens: int, roles: Sequence[str] = GENERIC_ROLES,
    decider_system: str = "You make the final decision. Be brief.", description: str = "",
    source: str = "<workload>",
) -> PipelineSpec:
    """KVCOMM's fully connected one-round topology over ``tasks`` (one input row ``{"task": t}`` each).

    ``agent{i}`` (system "You are agent i, <role>. Be brief.") sees the task and the replies of
    ``agent1..agent{i-1}`` and follows ``agent_instruction``; ``decider`` sees the task and all
    replies and follows ``decider_instruction``.
    """
    check_int("n_agents", n_agents, 1, MAX_AGENTS, source)
    names = [f"agent{i}" for i in range(1, n_agents + 1)]

    def template(seen: Sequence[str], instruction: str) -> str:
        text = "Task:\n{task}\n\n" + "".join(f"Agent {n[5:]} said:\n{{{n}}}\n\n" for n in seen)
        return text + instruction.replace("{", "{{").replace("}", "}}")

    agents = [{"name": n, "system": f"You are agent {i + 1}, {roles[i % len(roles)]}. Be brief.",
               "template": template(names[:i], agent_instruction)} for i, n in enumerate(names)]
    agents.append({"name": "decider", "system": decider_system, "template": template(names, decider_instruction)})
    return parse_pipeline({"agents": agents, "inputs": [{"task": t} for t in tasks],
                           "max_new_tokens": max_new_tokens, "description": description}, source)


def check_int(what: str, value: object, lo: int, hi: int | None, where: str) -> None:
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise WorkloadError(f"{where}: {what} must be an integer {bound}, got {value!r}")


def seeded_order(n: int, limit: int | None, seed: int) -> list[int]:
    """The first ``limit`` indices of a seeded shuffle of ``range(n)``."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order if limit is None else order[:limit]


def build_workload(name: str, rows: list[tuple[str, object, Mapping[str, object]]], n_agents: int, max_new_tokens: int,
            scorer: Scorer, agent_instruction: str, decider_instruction: str, description: str,
            roles: Sequence[str] = GENERIC_ROLES, decider_system: str = "You make the final decision. Be brief.",
            row_scorers: Sequence[Scorer | None] = ()) -> Workload:
    spec = default_pipeline([t for t, _, _ in rows], n_agents=n_agents, agent_instruction=agent_instruction,
                            decider_instruction=decider_instruction, max_new_tokens=max_new_tokens, roles=roles,
                            decider_system=decider_system, description=description, source=f"workload {name!r}")
    return Workload(name, spec, tuple(r for _, r, _ in rows), scorer,
                    tuple(MappingProxyType(dict(d)) for _, _, d in rows), tuple(row_scorers))
