"""kvcomm's ``Executor`` on vLLM: the same pipelines, engine and decisions as the
transformers reference, with prefill and decode run by a ``vllm.LLM`` through the kvcomm
connector.

Each call places an ``Order`` on the engine's channel (KV to inject for the first
``prefix.length`` prompt tokens, positions whose real KV to capture), submits the prompt as
token ids with the order's handle in ``kv_transfer_params``, and collects the captured KV
for ``ReuseEngine.learn``. Requests that inject KV carry a ``cache_salt`` unique to the call,
so vLLM's prefix cache never serves their (possibly approximate) blocks to anyone else.
Requests that inject nothing (dense calls, misses, base prefills) carry the executor's own
salt (``VllmExecutor(..., salt=)``, ``with_salt``; none by default): they share vLLM's prefix
cache with the requests of executors under the same salt only. Two systems compared on one
engine each take an executor of their own salt (``kvcomm.reuse.executor.namespaced``), so
neither is served blocks the other computed and each keeps prefix caching among its own calls.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Sequence

import torch

from kvcomm.reuse.executor import Generation, OnToken, check_preamble, fill_preamble
from kvcomm.core.kv import KV, to_position_free
from kvcomm.reuse.plan import BlendRequest
from kvcomm.core.segments import Segment
from kvcomm.integrations.transformers.executor import TransformersExecutor, _as_list
from kvcomm.integrations.vllm.wire.channel import Channel, Injection, Order, channel
from kvcomm.integrations.vllm.wire.params import SERVER_KEY
from kvcomm.integrations.vllm.inprocess.llm import shutdown_llm
from kvcomm.integrations.vllm.wire.config import CONNECTOR

_FINAL_STEPS = 4
"""Engine steps a finished request's capture may take to be copied (it takes one: the next)."""


class VllmExecutor:
    """Runs one agent call at a time on ``llm`` (a ``vllm.LLM`` from ``make_llm``, in-process).

    tokenizer: the served checkpoint's transformers tokenizer (``embedded.load_tokenizer``), for
    the chat template, encoding and decoding. No transformers model is needed: the stop tokens
    are the tokenizer's eos plus the ``eos_token_id`` of the generation config vLLM read for the
    served model, and the rotary numbers are vLLM's own (``vllm.connector.rotary``), read and self-checked
    by the connector at start-up.

    salt: vLLM ``cache_salt`` of this executor's requests that inject nothing (None: no salt,
    vLLM's shared unsalted prefix cache); see the module docstring and ``with_salt``.
    """

    computes_preambles = True
    """``generate`` takes ``preamble``: a request of its own computes it first (``_preamble``)."""

    # Text handling is the reference executor's, token for token (same tokenizer).
    encode = TransformersExecutor.encode
    decode = TransformersExecutor.decode
    render = TransformersExecutor.render

    def __init__(self, llm, tokenizer, salt: str | None = None):
        config = llm.llm_engine.vllm_config
        transfer = config.kv_transfer_config
        if transfer is None or transfer.kv_connector != CONNECTOR:
            raise ValueError("the vllm.LLM must load the kvcomm connector; build it with kvcomm.integrations.vllm.inprocess.llm.make_llm")
        import vllm.envs as envs

        if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            raise RuntimeError("VllmExecutor needs the engine in this process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM")
        self.llm = llm
        self.tokenizer = tokenizer
        self.channel: Channel = channel(str(transfer.engine_id))
        if self.channel.refusal is not None:
            raise RuntimeError(f"the kvcomm connector refused this engine at start-up: {self.channel.refusal}")
        if self.channel.rotary is None:
            raise RuntimeError(
                "this engine's kvcomm connector never registered its KV caches: its worker runs another engine's "
                "connector (vLLM keeps one per process, and an earlier in-process engine still held it). Shut "
                "earlier engines down before starting one (kvcomm.integrations.vllm.inprocess.llm.shutdown_llm), or "
                "build engines with make_llm, which refuses a second one"
            )
        self.rotary, self.self_check = self.channel.rotary, self.channel.rope_check  # vLLM's own, checked at start-up
        generation = config.model_config.try_get_generation_config()  # non-default fields of generation_config.json
        eos = {tokenizer.eos_token_id, *_as_list(generation.get("eos_token_id"))}
        self.stop_ids = {t for t in eos if t is not None}
        self.lead_in_ids = tokenizer.encode(tokenizer.bos_token or "\n", add_special_tokens=False)
        self.dtype = getattr(torch, str(config.model_config.dtype).replace("torch.", ""))
        self.salt = salt

    def with_salt(self, salt: str | None) -> "VllmExecutor":
        """Another executor on the same engine (the same ``vllm.LLM``, channel and tokenizer; no
        start-up, nothing copied) whose requests that inject nothing carry ``salt``: they are
        served only blocks computed under that salt. Closing either executor closes the engine."""
        other = copy.copy(self)
        other.salt = salt
        return other

    def close(self) -> None:
        """Shut the engine down (``llm.shutdown_llm``): its memory and its KV connector are
        released, so another in-process engine can start. The executor serves nothing afterwards."""
        shutdown_llm(self.llm)

    def __enter__(self) -> "VllmExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, token_ids: Sequence[int], order: Order, max_tokens: int, salted: bool, on_token: OnToken | None = None):
        """Submit one request under a fresh handle and step the engine until it finishes and the
        connector copied its captured KV (in the step after it finished, from the blocks vLLM
        kept for that; ``on_token`` sees each new token; False aborts the request). ``salted``: the request
        carries a salt of its own (it injects KV); otherwise the executor's ``salt``, if any.
        Returns (token ids, vLLM's number of cached prompt tokens: those the connector loaded
        plus vLLM's own prefix-cache hit, Capture, prompt completion time)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # A thread that has run no torch op yet (e.g. an AutoGen client's worker) holds OpenMP's
        # default thread count until its first one; vLLM's CPU attention sizes a step's metadata
        # by the count in force then and refuses a kernel run under another, so fix it first.
        torch.set_num_threads(torch.get_num_threads())
        handle = uuid.uuid4().hex
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("VllmExecutor runs one request at a time; the LLM has unfinished requests")
        self.channel.place(handle, order)
        prompt = TokensPrompt(prompt_token_ids=list(token_ids))
        if salted:
            prompt["cache_salt"] = f"kvcomm-{handle}"
        elif self.salt is not None:
            prompt["cache_salt"] = self.salt
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, stop_token_ids=sorted(self.stop_ids), detokenize=False,
            output_kind=RequestOutputKind.CUMULATIVE, extra_args={"kv_transfer_params": {"kvcomm": {}, SERVER_KEY: {"handle": handle}}},
        )
        request_id = f"kvcomm-{handle}"
        tokens: list[int] = []
        seen, cached, error, aborted = 0, 0, None, False
        try:
            engine.add_request(request_id, prompt, params)
            after = 0  # steps since the request finished, while its capture is being copied
            while engine.has_unfinished_requests() or self.channel.awaits_final(handle):
                if not engine.has_unfinished_requests():
                    after += 1
                    if after > _FINAL_STEPS:
                        raise RuntimeError(f"the kvcomm connector did not copy the captured KV of a finished request "
                                           f"within {_FINAL_STEPS} engine steps")
                for output in engine.step():
                    if output.request_id != request_id or aborted:
                        continue
                    cached = output.num_cached_tokens or 0
                    error = (output.kv_transfer_params or {}).get("kvcomm", {}).get("error") or error
                    new = [int(t) for t in output.outputs[0].token_ids[seen:]]
                    seen += len(new)
                    for token in new:
                        tokens.append(token)
                        if on_token is not None and token not in self.stop_ids and on_token(token) is False:
                            aborted = True
                            engine.abort_request([request_id])
                            break
        finally:
            capture, done_at = self.channel.take(handle)
        if error:
            raise RuntimeError(f"kvcomm connector rejected the request: {error}")
        if capture is None and order.capture_to > order.capture_from:
            raise RuntimeError("the kvcomm connector captured nothing; is the LLM running in this process?")
        return tokens, cached, capture, done_at

    def base_kv(self, segment: Segment) -> KV:
        """Prefill ``lead_in + segment`` alone (vLLM); keep the segment's KV, de-rotated."""
        lead = len(self.lead_in_ids)
        ids = self.lead_in_ids + list(segment.token_ids)
        _, _, capture, _ = self._run(ids, Order(None, lead, len(ids)), 1, salted=False)
        return to_position_free(capture.span(lead, len(ids)), self.rotary, lead)

    def generate(
        self, token_ids: Sequence[int], prefix: KV | None, max_new_tokens: int, started: float | None = None,
        keep_logprobs: bool = False, blend: BlendRequest | None = None, on_token: OnToken | None = None,
        preamble: tuple[int, int] | None = None,
    ) -> Generation:
        started = time.perf_counter() if started is None else started
        if keep_logprobs or blend is not None:
            raise ValueError(
                "the vLLM executor does not support keep_logprobs (KL evaluation) or CacheBlend's recompute; "
                "use the transformers backend for those, or --no-kl and modes other than cacheblend"
            )
        n = len(token_ids)
        reused = 0 if prefix is None else prefix.length
        if not 0 <= reused < n:
            raise ValueError(f"prefix covers {reused} of {n} prompt tokens; at least the last token must be computed")
        preamble_kv = None if preamble is None else self._preamble(token_ids, prefix, *preamble)
        inject = None if prefix is None else Injection.of_kv(prefix if prefix.keys.dtype == self.dtype else prefix.to(self.dtype))
        # One token past max_new_tokens, so the last reply token is fed back and its KV
        # (the next agent's base) is computed; the extra token is dropped.
        order = Order(inject, reused, n + max_new_tokens)
        stream = None
        if on_token is not None:
            budget = [max_new_tokens]

            def stream(token: int) -> bool | None:  # the extra token is not the caller's
                budget[0] -= 1
                return on_token(token) if budget[0] >= 0 else None

        tokens, cached, capture, done_at = self._run(token_ids, order, max_new_tokens + 1, prefix is not None, stream)
        if cached < reused:
            raise RuntimeError(f"vLLM reports {cached} cached prompt tokens, the connector claimed {reused}")
        reply: list[int] = []
        for token in tokens[:max_new_tokens]:
            if token in self.stop_ids:
                break
            reply.append(token)
        if done_at is None:
            raise RuntimeError("the kvcomm connector did not see the prompt's last token computed")
        # A call cancelled by on_token may end before its last reply token was fed back:
        # then its reply KV is not kept (downstream agents prefill the reply as a base).
        complete = reply and capture.has(n, n + len(reply))
        reply_kv = capture.span(n, n + len(reply)) if complete else None
        return Generation(tuple(reply), capture.span(reused, n), reply_kv, done_at - started, cached_tokens=cached - reused,
                          preamble=preamble_kv)

    def _preamble(self, token_ids: Sequence[int], prefix: KV | None, start: int, end: int) -> KV:
        """Compute prompt tokens ``[start, end)`` in a request of their own (the prompt's first
        ``end`` tokens, ``prefix``'s first ``start`` injected, one token generated and dropped),
        write their captured KV into ``prefix`` there (this call's memory) and return it. vLLM's
        connector supplies KV for one range right after its own prefix hit, so the reused KV
        after a preamble goes in with the call's own request, behind this preamble."""
        exact = check_preamble(prefix, start, end).span(0, start)
        inject = Injection.of_kv(exact if exact.keys.dtype == self.dtype else exact.to(self.dtype)) if start else None
        _, _, capture, _ = self._run(token_ids[:end], Order(inject, start, end), 1, salted=start > 0)
        return fill_preamble(prefix, start, capture.span(start, end))
