"""The quality guard's twins in `kvcomm serve` (``vllm.planning.guard``): how a request the guard sampled
is measured, after its response has gone out, so the client waits for nothing.

1. The dense twin: the same prompt as a kvcomm calibration request (``calibrate``, purpose ``dense_twin``: nothing
   reused, everything its prefill reveals learned, as the in-process guard's twin teaches its
   engine) of the request's tenant, template and segments, under the tenant's plain salt
   (exact KV only; vLLM's prefix cache may serve it from the tenant's plain requests), one
   token, the first token's top-k log-probabilities (``top_k``, the guard's; at most vLLM's
   ``--max-logprobs``). It is how a slot served realigned KV gets the dense sightings its
   estimate must earn (``kvcomm.anchors.evidence``).
2. The reuse twin: the same prompt under the request's reuse salt with the plan's twin
   ticket (purpose ``reuse_twin``): served the plan its request was served (vLLM's prefix cache
   may serve the request's own blocks, which hold the same KV), learning nothing; the
   log-probabilities of the dense twin's top-k tokens (``logprob_token_ids``).
3. KL(dense || reuse) over those tokens and an "other" bucket (``kl_topk_other_of``: a lower
   bound of the full KL, as the in-process guard measures) goes to every rank's guard
   (``collective_rpc`` of ``vllm.connector.worker_extension``'s ``kvcomm_guard_record``).

A failed twin or record costs the sample, never a request: it is counted and the first few
are logged. At most ``MAX_IN_FLIGHT`` measurements run at once; a sample beyond that is
skipped (its parked plan expires). The twins are requests like any other in vLLM's own
metrics and usage; kvcomm's counters skip both (their purposes).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from starlette.types import ASGIApp, Scope

from kvcomm.core.divergence import kl_topk_other_of
from kvcomm.integrations.serve.internal import call_app, kvcomm_error, kvcomm_of, say
from kvcomm.integrations.vllm.wire.params import SERVER_KEY

RPC = "kvcomm_guard_record"
MAX_IN_FLIGHT = 8
"""Twin measurements running at once, at most."""
_TOKEN_ID = "token_id:"


class TwinRequests:
    """The twins of sampled requests (module docstring). ``measured``: samples recorded;
    ``skipped``: samples not measured because ``MAX_IN_FLIGHT`` were running; ``failures``:
    twins or records that failed."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.measured = self.skipped = self.failures = 0
        self._tasks: set[asyncio.Task] = set()

    def after(self, scope: Scope, body: dict, sampled: tuple[str, int], dense_salt: str,
              measured: Callable[[], None]) -> None:
        """Measure the sampled request ``body`` (as vLLM got it) in the background: ``sampled``
        is (twin ticket, top-k) from the plan made ahead, ``dense_salt`` the ``cache_salt`` of
        the tenant's plain requests; ``measured`` is called once every rank recorded the KL."""
        if len(self._tasks) >= MAX_IN_FLIGHT:
            self.skipped += 1
            return
        task = asyncio.get_running_loop().create_task(self._measure(scope, body, *sampled, dense_salt, measured))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _measure(self, scope: Scope, body: dict, ticket: str, top_k: int, dense_salt: str,
                       measured: Callable[[], None]) -> None:
        started = time.perf_counter()
        try:
            kl = await self._kl(scope, body, ticket, top_k, dense_salt)
            engine = scope["app"].state.engine_client
            answers = await engine.collective_rpc(RPC, args=(ticket, kl, time.perf_counter() - started))
            if not all(isinstance(a, dict) and a.get("recorded") for a in answers):
                raise RuntimeError(f"the workers answered {str(answers)[:200]}")
            self.measured += 1
            measured()
        except Exception as error:  # a sample lost, never a request
            self.failures += 1
            if self.failures <= 3:
                say(f"a quality guard sample failed ({type(error).__name__}: {str(error)[:200]})")

    async def _kl(self, scope: Scope, body: dict, ticket: str, top_k: int, dense_salt: str) -> float:
        """KL(dense || reuse) of the first reply token from the two twins, nats."""
        options = kvcomm_of(body)
        common = {"model": body.get("model"), "prompt": body["prompt"], "max_tokens": 1, "temperature": 0.0,
                  "logprobs": top_k, "return_tokens_as_token_ids": True}
        segments = {"segments": options["segments"]} if "segments" in options else {}  # else detected, as for the request
        teach = {"kvcomm": {"tenant": options.get("tenant", "default"), "template": options.get("template", "default"),
                            **segments, "calibrate": True}, SERVER_KEY: {"purpose": "dense_twin"}}
        status, dense = await call_app(self.app, scope, "POST", "/v1/completions",
                                       {**common, "cache_salt": dense_salt, "kv_transfer_params": teach})
        error = kvcomm_error(dense)
        if error:
            raise RuntimeError(f"the dense twin was not served as calibration: {error}")
        reference = dict(sorted(_first_token_logprobs(status, dense).items(), key=lambda kv: -kv[1])[:top_k])
        twin = {**common, "logprob_token_ids": list(reference), "cache_salt": body["cache_salt"],
                "kv_transfer_params": {"kvcomm": {"tenant": options.get("tenant", "default"),
                                                  "template": options.get("template", "default")},
                                       SERVER_KEY: {"ticket": ticket, "purpose": "reuse_twin"}}}
        status, reuse = await call_app(self.app, scope, "POST", "/v1/completions", twin)
        error = kvcomm_error(reuse)
        if error:
            raise RuntimeError(f"the reuse twin was not served its plan: {error}")
        return kl_topk_other_of(reference, _first_token_logprobs(status, reuse))


def _first_token_logprobs(status: int, answer: Any) -> dict[int, float]:
    """token id -> log-probability of the first generated token's ``top_logprobs`` of a
    ``/v1/completions`` answer (``return_tokens_as_token_ids``)."""
    try:
        top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
        logprobs = {int(token.removeprefix(_TOKEN_ID)): float(value) for token, value in top.items()
                    if token.startswith(_TOKEN_ID)}
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        logprobs = {}
    if not logprobs:
        raise RuntimeError(f"a twin got no first-token log-probabilities (HTTP {status}): {str(answer)[:200]}")
    return logprobs
