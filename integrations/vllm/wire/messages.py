"""What the kvcomm connector's scheduler side (``vllm.connector.scheduler``) and worker side
(``vllm.connector.worker``) tell each other, as plain picklable values: vLLM carries them in the step's
``KVConnectorMetadata`` (``KvcommMetadata``, scheduler to worker) and in
``KVConnectorWorkerMetadata`` (``KvcommWorkerMetadata``, worker to scheduler), across processes
when the worker runs in a process of its own.

No KV travels here: the KV (bases, anchors, exact prefixes, injected KV, captures) stays in the
worker, which owns the ``ServerPlanner``; a ``StepRequest`` carries prompt positions and cache
slots only.

An annotated request's life (server-side planning): the scheduler sends a ``PlanAsk`` and
answers vLLM's lookup "not yet"; the worker plans it at the end of that step and answers with
a ``PlanAnswer``; the scheduler then claims ``inject_length`` tokens and sends slots
(``StepRequest``, under ``handle_of(req_id)``); when the request finishes, a ``FinalCapture``
names its blocks (held by vLLM until the worker copied them) and a ``Finished`` carries its
reply, so the worker can capture its KV once and learn from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvcomm.integrations.vllm.wire.params import KvcommParams


def handle_of(req_id: str) -> str:
    """The channel handle of a planned request (distinct from in-process callers' handles)."""
    return f"request-{req_id}"


@dataclass(frozen=True)
class PlanAsk:
    """Plan and materialize vLLM request ``req_id``.

    token_ids: the whole prompt; params: its validated ``kv_transfer_params["kvcomm"]``;
    salted: it carries a ``cache_salt`` (without one: exact reuse only); max_tokens: its
    reply budget (the worker keeps the reply's KV for learning); adapter: the identity of the
    LoRA adapter it runs under (``vllm.connector.scheduler.adapter_identity``; None: the base model).
    """

    req_id: str
    token_ids: tuple[int, ...]
    params: KvcommParams
    salted: bool
    max_tokens: int
    adapter: str | None = None


@dataclass(frozen=True)
class PlanAnswer:
    """The worker's plan for one request: inject prompt positions ``[0, inject_length)``,
    capture real KV of positions ``[capture_from, capture_to)`` (from the end of the reused
    range to the prompt's end, plus the reply's when it is learned from). ``summary`` is
    the per-request provenance returned to the client (``PlannedRequest.summary``).
    With ``error`` set the request gets no reuse and the error is returned instead."""

    inject_length: int = 0
    capture_from: int = 0
    summary: dict | None = None
    error: str | None = None
    capture_to: int | None = None


@dataclass(frozen=True)
class Finished:
    """Request ``req_id`` finished; ``reply_ids``: its output tokens without a final stop
    token. The worker learns from its captured KV (in this step, or a later one when this
    step's learning budget is spent, ``vllm.planning.worker_plans``) and forgets it."""

    req_id: str
    reply_ids: tuple[int, ...]


@dataclass
class StepRequest:
    """One request's connector work in one engine step (sent only for steps that load or that
    compute the prompt's last token).

    load_positions/load_slots: prompt positions to inject (``[N]`` int64, consecutive) and their
    cache slots, on the host as the scheduler builds them (the worker's fused writer uploads the
    slots with its tables). prompt_done: this step computes the request's last prompt token.
    """

    handle: str
    load_positions: torch.Tensor
    load_slots: torch.Tensor
    prompt_done: bool


@dataclass(frozen=True)
class FinalCapture:
    """A finished request's KV to keep: positions ``[start, end)``, copied once, in the step
    after the request finished, out of its blocks into a capture of exactly those positions
    (``channel.Capture``, under ``handle``).

    vLLM keeps the blocks until then: the scheduler side's ``request_finished`` asked it to delay
    their free, and the worker reports ``req_id`` in ``get_finished``'s finished-sending set in
    the step it copied them (or skipped the copy: the caller took its order back, the connector
    is off), which frees them. block_ids: the request's KV cache blocks (its one KV cache group)
    in position order, covering at least positions ``[0, end)``; block_size: tokens per block.
    """

    req_id: str
    handle: str
    block_ids: tuple[int, ...]
    block_size: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= len(self.block_ids) * self.block_size:
            raise ValueError(f"final capture of {self.req_id!r}: positions [{self.start}, {self.end}) do not lie in its "
                             f"{len(self.block_ids)} blocks of {self.block_size} tokens")

    def slots(self) -> torch.Tensor:
        """Cache slots of positions ``[start, end)`` (``[end - start]`` int64, on the host)."""
        positions = torch.arange(self.start, self.end)
        blocks = torch.tensor(self.block_ids, dtype=torch.int64)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size


@dataclass
class KvcommMetadata(KVConnectorMetadata):
    """One step's scheduler-to-worker message: loads of scheduled requests, the KV of requests
    that finished since the last step to capture (``final``, copied before anything is learned),
    and for annotated requests the plans to make and the finished requests to learn from (the
    worker handles ``finished`` before ``asks``, so a reply is learned before the next plan)."""

    requests: list[StepRequest] = field(default_factory=list)
    asks: list[PlanAsk] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    final: list[FinalCapture] = field(default_factory=list)


@dataclass
class KvcommWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's answers from the worker(s), keyed by vLLM request id, and the finished
    requests whose captured KV the worker let go of this step (learned from, or nothing to
    learn): the scheduler releases their capture bytes."""

    answers: dict[str, PlanAnswer] = field(default_factory=dict)
    released: tuple[str, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvcommWorkerMetadata":
        """Answers of several workers for one step. Tensor-parallel ranks each answer every
        request, and must agree: a request the ranks planned differently gets no reuse (an
        error answer), since each rank would inject its heads of a different plan."""
        if not isinstance(other, KvcommWorkerMetadata):
            raise TypeError(f"cannot aggregate kvcomm worker metadata with {type(other).__name__}")
        answers = {**other.answers, **self.answers}
        for req_id, theirs in other.answers.items():
            mine = self.answers.get(req_id)
            if mine is not None and mine != theirs and mine.error is None:
                answers[req_id] = PlanAnswer(error=f"kvcomm: tensor-parallel ranks planned this request differently "
                                                   f"({mine} vs {theirs}); served without reuse")
        # every rank learns the same requests in the same steps (a budget in positions, not time)
        return KvcommWorkerMetadata(answers, tuple(dict.fromkeys(self.released + other.released)))
