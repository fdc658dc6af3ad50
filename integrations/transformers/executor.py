"""The reference executor: a transformers causal LM with KV capture and injection.

Dense prefill, injection of assembled KV through a ``DynamicCache``, dense tail and greedy
decoding, one request at a time, batch size 1. It is the reference other runtimes (the
vLLM plugin) must agree with. It also runs CacheBlend's selective recompute (mode
"cacheblend", ``_blend``) and keeps prompt log-probabilities for KL evaluations.
"""

from __future__ import annotations

import re
import time
from typing import Sequence

import torch
from transformers import DynamicCache

from kvcomm.reuse.executor import Generation, OnToken, check_preamble, fill_preamble
from kvcomm.core.kv import KV, to_position_free
from kvcomm.reuse.pipeline import Slot
from kvcomm.reuse.plan import BlendRequest
from kvcomm.core.segments import Segment
from kvcomm.integrations.transformers.rotary import rotary_from_model

_MARK = re.compile("\ue000([^\ue001]*)\ue001")


def _mark(name: str) -> str:
    return f"\ue000{name}\ue001"


class TransformersExecutor:
    """Runs one agent call at a time on ``model`` (eval mode; fp32, bf16 or fp16).

    The KV it returns and accepts is in the model's dtype (``kv_dtype``); a prefix in another
    float dtype is cast to it once on injection. The model may sit on any device (``device``,
    e.g. a CUDA GPU): the KV it returns lives there too, so an engine fed by it keeps its bases,
    deviations and prefixes in that device's memory and assembles reused KV there (a prefix
    from elsewhere is copied over once per call); ``prompt_logprobs`` come back in host memory.

    Raises ``RopeError`` at construction if the model's RoPE cannot be realigned to within its
    dtype's rounding (``transformers.rotary.self_check``); use ``dense_only=True`` to run such
    a model without reuse.
    """

    computes_preambles = True
    """``generate`` takes ``preamble``: plans may compute new text before the reused content."""

    def __init__(self, model, tokenizer, dense_only: bool = False):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.rotary, self.self_check = (None, None) if dense_only else rotary_from_model(model)
        self.kv_dtype = model.dtype if model.dtype.is_floating_point else torch.float32
        eos = {tokenizer.eos_token_id, *(_as_list(getattr(model.generation_config, "eos_token_id", None)))}
        self.stop_ids = {t for t in eos if t is not None}
        lead_in = tokenizer.bos_token or "\n"
        self.lead_in_ids = tokenizer.encode(lead_in, add_special_tokens=False)

    # -- text ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def render(self, system: str, parts: Sequence[str | Slot]) -> list[str | Slot]:
        for part in parts:
            if isinstance(part, str) and ("\ue000" in part or "\ue001" in part):
                raise ValueError("template text may not contain the private-use characters U+E000/U+E001")
        user = "".join(_mark(p.name) if isinstance(p, Slot) else p for p in parts)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pieces = _MARK.split(text)  # text, name, text, name, ..., text
        out: list[str | Slot] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append(Slot(piece))
            elif piece:
                out.append(piece)
        return out

    # -- KV --------------------------------------------------------------------------------

    @torch.no_grad()
    def _forward(self, ids: Sequence[int], cache: DynamicCache, start: int, all_logits: bool = False) -> torch.Tensor:
        """Logits of the last token (``[vocab]``), or of every token (``[len(ids), vocab]``)."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)[None]
        out = self.model(
            input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        return out.logits[0] if all_logits else out.logits[0, -1]

    @staticmethod
    def _span(cache: DynamicCache, start: int, end: int) -> KV:
        keys = torch.stack([layer.keys[0, :, start:end] for layer in cache.layers])
        values = torch.stack([layer.values[0, :, start:end] for layer in cache.layers])
        return KV(keys, values)

    def base_kv(self, segment: Segment) -> KV:
        """Prefill ``lead_in + segment`` alone; keep the segment's KV, de-rotated."""
        cache = DynamicCache(config=self.model.config)
        lead = len(self.lead_in_ids)
        self._forward(self.lead_in_ids + list(segment.token_ids), cache, 0)
        return to_position_free(self._span(cache, lead, lead + len(segment)), self.rotary, lead)

    def _cache(self, prefix: KV | None) -> DynamicCache:
        """A cache holding ``prefix`` (on the model's device, in ``kv_dtype``) as views of it, no
        copy and no device operation: the first forward's append reads it once (``torch.cat``),
        while the memory it views is still lent (``ReuseEngine.materialized``)."""
        cache = DynamicCache(config=self.model.config)
        if prefix is None:
            return cache
        for i, layer in enumerate(cache.layers):
            layer.dtype, layer.device = prefix.keys.dtype, prefix.keys.device
            layer.keys, layer.values = prefix.keys[i][None], prefix.values[i][None]
            layer.is_initialized = True
        return cache

    def generate(
        self, token_ids: Sequence[int], prefix: KV | None, max_new_tokens: int, started: float | None = None,
        keep_logprobs: bool = False, blend: BlendRequest | None = None, on_token: OnToken | None = None,
        preamble: tuple[int, int] | None = None,
    ) -> Generation:
        started = time.perf_counter() if started is None else started
        n = len(token_ids)
        reused = 0 if prefix is None else prefix.length
        if not 0 <= reused < n:
            raise ValueError(f"prefix covers {reused} of {n} prompt tokens; at least the last token must be computed")
        if prefix is not None:
            prefix = KV(prefix.keys.to(self.device, self.kv_dtype), prefix.values.to(self.device, self.kv_dtype))
        preamble_kv = None if preamble is None else self._preamble(token_ids, prefix, *preamble)
        cache = self._cache(prefix)
        recomputed: tuple[int, ...] = ()
        if blend is not None:
            if prefix is None or not 0 <= blend.start < blend.end <= reused:
                raise ValueError(f"blend range [{blend.start}, {blend.end}) is not inside the {reused}-token prefix")
            recomputed = self._blend(token_ids, prefix, cache, blend)
        logits = self._forward(token_ids[reused:], cache, reused, all_logits=keep_logprobs)
        logprobs = None
        if keep_logprobs:
            logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
            logits = logits[-1]
        ttft = time.perf_counter() - started
        reply: list[int] = []
        while len(reply) < max_new_tokens:
            token = int(torch.argmax(logits))
            if token in self.stop_ids:
                break
            reply.append(token)
            if on_token is not None and on_token(token) is False:
                break
            if len(reply) < max_new_tokens:
                logits = self._forward([token], cache, n + len(reply) - 1)
        if reply and cache.get_seq_length() < n + len(reply):
            self._forward(reply[-1:], cache, n + len(reply) - 1)  # the reply's KV is the next agent's base
        reply_kv = self._span(cache, n, n + len(reply)) if reply else None
        return Generation(tuple(reply), self._span(cache, reused, n), reply_kv, ttft, logprobs, recomputed, preamble=preamble_kv)

    def _preamble(self, token_ids: Sequence[int], prefix: KV | None, start: int, end: int) -> KV:
        """Compute prompt tokens ``[start, end)`` behind ``prefix``'s first ``start`` tokens, write
        their KV into ``prefix`` there (it is this call's memory) and return a copy of it."""
        cache = self._cache(check_preamble(prefix, start, end).span(0, start) if start else None)
        self._forward(token_ids[start:end], cache, start)
        return fill_preamble(prefix, start, self._span(cache, start, end))

    # -- CacheBlend ------------------------------------------------------------------------

    @torch.no_grad()
    def _blend(self, token_ids: Sequence[int], prefix: KV, cache: DynamicCache, blend: BlendRequest) -> tuple[int, ...]:
        """Selective recompute on the injected ``cache``.

        Takes (CacheBlend, Yao et al. 2024) the ``blend.count`` tokens of ``[blend.start,
        blend.end)`` whose keys at layer ``blend.check_layer`` deviate most (L2 over heads and
        channels) from the real keys;
        recomputes them through every layer in one forward, each attending to the injected
        KV of unselected tokens before it and to selected tokens at or before it, and writes
        their KV into ``cache`` at their positions. Returns the sorted positions.
        """
        layers = prefix.keys.shape[0]
        if blend.check_layer >= layers:
            raise ValueError(f"check_layer {blend.check_layer} is out of range for a {layers}-layer model")
        start, end, count = blend.start, blend.end, blend.count
        if count >= end - start:
            selected = torch.arange(start, end, device=self.device)
        else:
            real = self._check_keys(token_ids, prefix, blend)
            injected = prefix.keys[blend.check_layer, :, start:end].to(real.dtype)
            deviation = (real - injected).float().pow(2).sum(dim=(0, 2))  # [T]
            selected = torch.sort(torch.topk(deviation, count).indices).values + start
        self._recompute(token_ids, cache, selected, end)
        return tuple(int(p) for p in selected)

    def _check_keys(self, token_ids: Sequence[int], prefix: KV, blend: BlendRequest) -> torch.Tensor:
        """Real keys at ``blend.check_layer`` of prompt tokens ``[blend.start, blend.end)``,
        ``[kv_heads, T, head_dim]``: the model runs its first ``check_layer + 1`` decoder layers
        on those tokens behind the exact prefix ``[0, blend.start)`` (the model's own embedding,
        rotary and mask; a forward hook stops it after the check layer, removed in ``finally``)."""
        c, start, end = blend.check_layer, blend.start, blend.end
        cache = self._cache(prefix.span(0, start) if start else None)
        layer = _decoder_layers(self.model)[c]

        def stop(*_):
            raise _StopForward

        handle = layer.register_forward_hook(stop)
        try:
            self._forward(token_ids[start:end], cache, start)
        except _StopForward:
            pass
        finally:
            handle.remove()
        keys = cache.layers[c].keys
        if keys is None or keys.shape[-2] != end:
            raise RuntimeError(f"check forward left {0 if keys is None else keys.shape[-2]} keys at layer {c}, expected {end}")
        return keys[0, :, start:end]

    def _recompute(self, token_ids: Sequence[int], cache: DynamicCache, selected: torch.Tensor, end: int) -> None:
        """One forward of the ``selected`` tokens (sorted positions < ``end`` == cache length)
        through every layer, then their KV replaces the injected KV at their positions."""
        k = selected.numel()
        dtype = self.kv_dtype
        cached = torch.arange(end, device=self.device)
        stale = torch.zeros(end, dtype=torch.bool, device=self.device)
        stale[selected] = True
        # query i (position p_i) sees injected KV at j < p_i unless j is selected, and selected
        # tokens m <= i (their fresh KV is appended after the cache, at cache index end + m).
        sees_cached = (cached[None, :] < selected[:, None]) & ~stale[None, :]
        sees_fresh = torch.ones(k, k, dtype=torch.bool, device=self.device).tril()
        allowed = torch.cat([sees_cached, sees_fresh], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
        input_ids = torch.tensor([[token_ids[int(p)] for p in selected]], dtype=torch.long, device=self.device)
        self.model(
            input_ids=input_ids, position_ids=selected[None], attention_mask=mask,
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )
        for layer in cache.layers:
            keys, values = layer.keys[..., :end, :], layer.values[..., :end, :]
            keys[..., selected, :] = layer.keys[..., end:, :]
            values[..., selected, :] = layer.values[..., end:, :]
            layer.keys, layer.values = keys, values


class _StopForward(Exception):
    """Raised by a forward hook to end a truncated forward after the check layer."""


def _decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.model.layers`` for Llama-likes)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} for CacheBlend's check layer")
    return layers


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]
