"""One opted-in ``/v1/completions`` request's life in `kvcomm serve`, as one state machine: the
stages it goes through, in this order, each at most once (docs/serving.md, "A served request",
has the sequence diagram):

``received -> planned -> preamble computed -> served -> measured``

- **received**: the middleware read the body (bounded), rewrote it (tenant, salt,
  ``kvcomm_server`` removed) and checked its options; a bad body got its 400 before this.
- **planned**: planned ahead on every worker under a fresh ticket (``serve.preambles``, one
  ``collective_rpc``). Not reached by a request that is planned in the engine step instead
  (text prompts, LoRA adapters, calibration, no reuse salt) or whose planning failed.
- **preamble computed**: its preamble request computed the plan's preamble (one engine request). Skipped
  when the plan has none; a failed preamble request leaves the request planned, served its exact
  prefix only, and not measured.
- **served**: vLLM answered it with status 200, the connector serving the plan made ahead. The
  worker learns from it in the engine step after its last token (``ServerPlanner.finish``),
  whatever the API server does meanwhile.
- **measured**: the quality guard sampled its plan and its twins measured it, after the
  response (``serve.twins``: two engine requests and one ``collective_rpc``, in the background;
  the client waits for none of it).

A sampled request with a preamble costs four engine requests (its preamble, itself, two twins) and two
``collective_rpc`` calls (plan ahead, record the KL); one neither sampled nor with a preamble, one
engine request and one call.
"""

from __future__ import annotations

from enum import Enum

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcomm.integrations.serve.preambles import PreambleRequests, PlannedAhead
from kvcomm.integrations.serve.internal import kvcomm_of
from kvcomm.integrations.serve.salts import salt_of
from kvcomm.integrations.serve.twins import TwinRequests


class Stage(Enum):
    RECEIVED = "received"
    PLANNED = "planned"
    PREAMBLE_COMPUTED = "preamble computed"
    SERVED = "served"
    MEASURED = "measured"


ORDER = tuple(Stage)
"""The stages in the order a request may reach them."""


class ServedRequest:
    """One request's stages (module docstring). ``body``: the request as vLLM will see it
    (rewritten by the middleware; planning ahead adds its ticket). ``stages``: the stages it
    reached, in order; ``stage``: the last."""

    def __init__(self, scope: Scope, body: dict, preambles: PreambleRequests, twins: TwinRequests):
        self.scope, self.body = scope, body
        self.stages = [Stage.RECEIVED]
        self.ahead: PlannedAhead | None = None
        self._preambles, self._twins = preambles, twins

    @property
    def stage(self) -> Stage:
        return self.stages[-1]

    def reach(self, stage: Stage) -> None:
        """Move on to ``stage``; a stage behind the current one, or reached twice, is a bug."""
        if ORDER.index(stage) <= ORDER.index(self.stage):
            raise RuntimeError(f"a served request cannot go from {self.stage.value} to {stage.value}")
        self.stages.append(stage)

    async def prepare(self) -> None:
        """received -> planned -> preamble computed, as far as the request goes."""
        self.ahead = await self._preambles.plan_ahead(self.scope, self.body)
        if self.ahead is None:
            return
        self.reach(Stage.PLANNED)
        if self.ahead.preamble is not None:
            if not await self._preambles.compute_preamble(self.scope, self.body, self.ahead):
                return
            self.reach(Stage.PREAMBLE_COMPUTED)

    async def serve(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Hand the request to vLLM's app (``scope`` and ``receive`` carry the rewritten body);
        served once it answered 200."""
        status = []

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await app(scope, receive, sent)
        if status == [200]:
            self.reach(Stage.SERVED)

    def measure(self) -> None:
        """Start the twins of a served request the guard sampled, in the background (the dense
        twin under its tenant's plain ``cache_salt``); measured when they recorded its KL. A
        request whose preamble request failed reused its exact prefix only: nothing to measure."""
        sampled = self.ahead.sampled if self.ahead is not None else None
        if self.stage is not Stage.SERVED or sampled is None or (self.ahead.preamble is not None
                                                                 and Stage.PREAMBLE_COMPUTED not in self.stages):
            return
        dense_salt = salt_of(kvcomm_of(self.body).get("tenant", "default"), False)
        self._twins.after(self.scope, self.body, sampled, dense_salt, lambda: self.reach(Stage.MEASURED))
