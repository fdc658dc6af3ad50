"""Preambles in `kvcomm serve`: a request whose plan computes new text (an agent's unseen
system prompt) and then serves shared content after it, as the in-process runner plans.

vLLM's connector supplies KV for one range right after vLLM's own prefix hit, so such a plan
needs its preamble computed first. For every opted-in ``/v1/completions`` request of the base model
with a token-id prompt and a reuse salt, the request's state machine (``serve.served_request``):

1. plans it ahead on the workers, outside the engine step (``collective_rpc`` of
   ``vllm.connector.worker_extension``; ``ServerPlanner.plan_ahead``: ``engine.plan(..., computes_preambles=True)``,
   parked under a fresh ticket), every rank the same way;
2. when the plan computes a preamble ``[start, end)``: sends a request of its own for the prompt's
   first ``end`` tokens (purpose ``preamble``; one token generated, dropped), which injects the
   exact prefix, computes the preamble and leaves its KV with the ticket (and its blocks in vLLM's
   prefix cache, under the request's salt);
3. sends the request with the ticket: it is served the plan made ahead.

When the quality guard sampled the plan, the plan made ahead carries its twin ticket and top-k
for the twins sent after the response (``serve.twins``).

A failed step costs reuse, never the request: no answer from the workers, or ranks that
disagree, and the request is planned in the engine step as before (no preamble); a preamble request
that fails, and the request reuses its exact prefix only. Requests under a LoRA adapter, with
text prompts, or calibrating are planned in the step as before. The client's TTFT includes
both steps (the preamble request's prefill is part of the call's cost).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Scope

from kvcomm.integrations.serve.internal import call_app, kvcomm_error, kvcomm_of, say
from kvcomm.integrations.vllm.wire.params import SERVER_KEY

RPC = "kvcomm_plan_ahead"
PLAN_AHEAD_ENV = "KVCOMM_PLAN_AHEAD"
""""0": requests are not planned ahead (`kvcomm serve --no-plan`, set by the command)."""


@dataclass(frozen=True)
class PlannedAhead:
    """A request planned ahead on every worker: its ``ticket``, the preamble ``(start, end)``
    its preamble request must compute (None: no preamble), and (twin ticket, top-k) when the quality
    guard sampled the plan (else None)."""

    ticket: str
    preamble: tuple[int, int] | None
    sampled: tuple[str, int] | None


class PreambleRequests:
    """The plan-ahead and preamble-request steps of opted-in requests (module docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.enabled = os.environ.get(PLAN_AHEAD_ENV, "1") != "0"
        self.failures = 0

    async def plan_ahead(self, scope: Scope, body: dict) -> PlannedAhead | None:
        """Step 1 for ``body`` (rewritten by the middleware): plan it on every worker and add
        the ticket to it (``kvcomm_server.ticket``); None where it is not planned ahead (it is
        planned in the engine step)."""
        options = kvcomm_of(body)
        prompt = body.get("prompt")
        if not (self.enabled and isinstance(options, dict) and isinstance(body.get("cache_salt"), str)
                and isinstance(prompt, list) and len(prompt) > 1 and all(type(t) is int for t in prompt)
                and not options.get("calibrate")):
            return None
        state = getattr(scope.get("app"), "state", None)
        engine, models = getattr(state, "engine_client", None), getattr(state, "openai_serving_models", None)
        if engine is None or models is None or not models.is_base_model(body.get("model") or models.model_name()):
            return None
        if len(prompt) >= getattr(getattr(engine, "model_config", None), "max_model_len", 1 << 20):
            return None  # vLLM refuses it; nothing to plan
        ticket = uuid.uuid4().hex
        try:
            answers = await engine.collective_rpc(RPC, args=(ticket, prompt, options))
        except Exception as error:
            if f"{RPC!r} is not implemented" in str(error):  # vLLM's words: the server runs another --worker-extension-cls
                self.enabled = False
                say(f"preambles are off: the workers cannot plan ahead ({str(error)[:200]})")
            else:  # e.g. options that could not travel; the engine step reports them to the request
                self._failed(f"planning ahead failed ({type(error).__name__}: {str(error)[:200]})")
            return None
        outcomes = {_outcome(answer) for answer in answers}
        if len(outcomes) != 1 or "error" in outcomes:
            self._failed(f"planning ahead answered {sorted(map(str, outcomes))[:2]}")
            return None
        body["kv_transfer_params"][SERVER_KEY] = {"ticket": ticket}
        preamble, sampled = outcomes.pop()
        return PlannedAhead(ticket, preamble, sampled)

    async def compute_preamble(self, scope: Scope, body: dict, ahead: PlannedAhead) -> bool:
        """Step 2: the preamble request of ``ahead.preamble``; False when it failed (the request then
        reuses its exact prefix only)."""
        options, prompt, ticket = kvcomm_of(body), body["prompt"], ahead.ticket
        start, end = ahead.preamble
        request = {"model": body.get("model"), "prompt": prompt[:end], "max_tokens": 1, "temperature": 0.0,
                   "cache_salt": body["cache_salt"],
                   "kv_transfer_params": {"kvcomm": {"tenant": options.get("tenant", "default"),
                                                     "template": options.get("template", "default")},
                                          SERVER_KEY: {"ticket": ticket, "purpose": "preamble"}}}
        status, answer = await call_app(self.app, scope, "POST", "/v1/completions", request)
        error = kvcomm_error(answer)
        if status != 200 or error:
            self._failed(f"the preamble request of tokens [{start}, {end}) failed (HTTP {status}): {str(error or answer)[:200]}")
            return False
        return True

    def _failed(self, why: str) -> None:
        self.failures += 1
        if self.failures <= 3:  # one request must not flood the log
            say(f"{why}; the request is served without its preamble")


def _outcome(answer: Any) -> tuple[tuple[int, int] | None, tuple[str, int] | None] | str:
    """A rank's plan-ahead answer as (preamble, (twin ticket, top-k) or None), or "error"."""
    if not isinstance(answer, dict) or "error" in answer or "preamble" not in answer:
        return "error"
    preamble, twin = answer["preamble"], answer.get("twin")
    return (None if preamble is None else (int(preamble[0]), int(preamble[1])),
            None if twin is None else (str(twin["ticket"]), int(twin["top_k"])))
