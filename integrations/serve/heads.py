"""Computed heads in `kvcomm serve`: a request whose plan computes new text (an agent's unseen
system prompt) and then serves shared content after it, as the in-process runner plans.

vLLM's connector supplies KV for one range right after vLLM's own prefix hit, so such a plan
needs its head computed first. For every opted-in ``/v1/completions`` request of the base model
with a token-id prompt and a reuse salt, the middleware (``HeadRequests.before``):

1. plans it ahead on the workers, outside the engine step (``collective_rpc`` of
   ``vllm.worker_extension``; ``ServerPlanner.plan_ahead``: ``engine.plan(..., heads=True)``,
   parked under a fresh ticket), every rank the same way;
2. when the plan computes a head ``[start, end)``: sends a request of its own for the prompt's
   first ``end`` tokens (``computes_head``; one token generated, dropped), which injects the
   exact prefix, computes the head and leaves its KV with the ticket (and its blocks in vLLM's
   prefix cache, under the request's salt);
3. sends the request with the ticket: it is served the plan made ahead.

A failed step costs reuse, never the request: no answer from the workers, or ranks that
disagree, and the request is planned in the engine step as before (no head); a head request
that fails, and the request reuses its exact prefix only. Requests under a LoRA adapter, with
text prompts, or calibrating are planned in the step as before. The client's TTFT includes
both steps (the head request's prefill is part of the call's cost).
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

from starlette.types import ASGIApp, Scope

from kvcomm.integrations.serve.internal import call_app, kvcomm_error, kvcomm_of

RPC = "kvcomm_plan_ahead"


class HeadRequests:
    """The plan-ahead and head-request steps of opted-in requests (module docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.enabled = True
        self.failures = 0

    async def before(self, scope: Scope, body: dict) -> None:
        """Run steps 1-2 for ``body`` (rewritten by the middleware) and add the ticket to it."""
        options = kvcomm_of(body)
        prompt = body.get("prompt")
        if not (self.enabled and isinstance(options, dict) and isinstance(body.get("cache_salt"), str)
                and isinstance(prompt, list) and len(prompt) > 1 and all(type(t) is int for t in prompt)
                and not options.get("calibrate")):
            return
        state = getattr(scope.get("app"), "state", None)
        engine, models = getattr(state, "engine_client", None), getattr(state, "openai_serving_models", None)
        if engine is None or models is None or not models.is_base_model(body.get("model") or models.model_name()):
            return
        if len(prompt) >= getattr(getattr(engine, "model_config", None), "max_model_len", 1 << 20):
            return  # vLLM refuses it; nothing to plan
        ticket = uuid.uuid4().hex
        try:
            answers = await engine.collective_rpc(RPC, args=(ticket, prompt, options))
        except Exception as error:
            if f"{RPC!r} is not implemented" in str(error):  # vLLM's words: the server runs another --worker-extension-cls
                self.enabled = False
                _say(f"computed heads are off: the workers cannot plan ahead ({str(error)[:200]})")
            else:  # e.g. options that could not travel; the engine step reports them to the request
                self._failed(f"planning ahead failed ({type(error).__name__}: {str(error)[:200]})")
            return
        heads = {_head(answer) for answer in answers}
        if len(heads) != 1 or "error" in heads:
            self._failed(f"planning ahead answered {sorted(map(str, heads))[:2]}")
            return
        options["ticket"] = ticket
        head = heads.pop()
        if head is None:
            return
        start, end = head
        request = {"model": body.get("model"), "prompt": prompt[:end], "max_tokens": 1, "temperature": 0.0,
                   "cache_salt": body["cache_salt"],
                   "kv_transfer_params": {"kvcomm": {"tenant": options.get("tenant", "default"),
                                                     "template": options.get("template", "default"),
                                                     "ticket": ticket, "computes_head": True}}}
        status, answer = await call_app(self.app, scope, "POST", "/v1/completions", request)
        error = kvcomm_error(answer)
        if status != 200 or error:
            self._failed(f"the head request of tokens [{start}, {end}) failed (HTTP {status}): {str(error or answer)[:200]}")

    def _failed(self, why: str) -> None:
        self.failures += 1
        if self.failures <= 3:  # one request must not flood the log
            _say(f"{why}; the request is served without its computed head")


def _head(answer: Any) -> tuple[int, int] | None | str:
    if not isinstance(answer, dict) or "error" in answer or "head" not in answer:
        return "error"
    head = answer["head"]
    return None if head is None else (int(head[0]), int(head[1]))


def _say(line: str) -> None:
    # printed, as the middleware prints its route table: vLLM's logging setup leaves other
    # packages' loggers without a handler in the API server
    print(f"kvcomm: {line}", file=sys.stderr, flush=True)
