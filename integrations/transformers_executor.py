"""The reference executor: a transformers causal LM with KV capture and injection.

Dense prefill, injection of assembled KV through a ``DynamicCache``, dense tail and greedy
decoding, one request at a time, batch size 1. It is the reference other runtimes (the
vLLM plugin) must agree with.
"""

from __future__ import annotations

import re
import time
from typing import Sequence

import torch
from transformers import DynamicCache

from kvcomm.executor import Generation
from kvcomm.kv import KV, to_position_free
from kvcomm.pipeline import Slot
from kvcomm.segments import Segment
from kvcomm.integrations.hf_rotary import rotary_from_model

_MARK = re.compile("\ue000([^\ue001]*)\ue001")


def _mark(name: str) -> str:
    return f"\ue000{name}\ue001"


class TransformersExecutor:
    """Runs one agent call at a time on ``model`` (eval mode, fp32 recommended on CPU).

    Raises ``RopeError`` at construction if the model's RoPE cannot be realigned exactly;
    use ``dense_only=True`` to run such a model without reuse.
    """

    def __init__(self, model, tokenizer, dense_only: bool = False):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.rotary, self.self_check = (None, None) if dense_only else rotary_from_model(model)
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
    def _forward(self, ids: Sequence[int], cache: DynamicCache, start: int) -> torch.Tensor:
        input_ids = torch.tensor([list(ids)], dtype=torch.long)
        positions = torch.arange(start, start + len(ids))[None]
        out = self.model(input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True)
        return out.logits[0, -1]

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

    def generate(self, token_ids: Sequence[int], prefix: KV | None, max_new_tokens: int, started: float | None = None) -> Generation:
        started = time.perf_counter() if started is None else started
        n = len(token_ids)
        reused = 0 if prefix is None else prefix.length
        if not 0 <= reused < n:
            raise ValueError(f"prefix covers {reused} of {n} prompt tokens; at least the last token must be computed")
        if prefix is None:
            cache = DynamicCache(config=self.model.config)
        else:
            layers = [(prefix.keys[i][None], prefix.values[i][None]) for i in range(prefix.keys.shape[0])]
            cache = DynamicCache(ddp_cache_data=layers, config=self.model.config)
        logits = self._forward(token_ids[reused:], cache, reused)
        ttft = time.perf_counter() - started
        reply: list[int] = []
        while len(reply) < max_new_tokens:
            token = int(torch.argmax(logits))
            if token in self.stop_ids:
                break
            reply.append(token)
            if len(reply) < max_new_tokens:
                logits = self._forward([token], cache, n + len(reply) - 1)
        if reply and cache.get_seq_length() < n + len(reply):
            self._forward(reply[-1:], cache, n + len(reply) - 1)  # the reply's KV is the next agent's base
        reply_kv = self._span(cache, n, n + len(reply)) if reply else None
        return Generation(tuple(reply), self._span(cache, reused, n), reply_kv, ttft)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]
