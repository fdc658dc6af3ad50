"""Every RoPE variant transformers implements, as tiny random models built from configs (hidden
64, 2 layers, 4 heads, 2 KV heads, vocab 128): what ``tests/core/test_rope.py`` checks realignment
against and what ``benchmarks/gpu_core_check.py`` self-checks on a GPU. Needs torch and
transformers only (the GPU machine has no pytest)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import transformers

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
HEAD_DIM = 16
THETA = 10000.0


@dataclass(frozen=True)
class Variant:
    name: str
    config: str  # transformers config class
    model: str  # transformers model class
    kwargs: tuple  # extra config kwargs (hashable)
    interleaved: bool = False
    rotary_dim: int = HEAD_DIM
    attention_scaling: float = 1.0
    max_exact_length: int | None = None


def _llama(name, rope, **expect):
    return Variant(name, "LlamaConfig", "LlamaForCausalLM", (("rope_parameters", rope),), **expect)


class Rope(tuple):
    """Hashable ``rope_parameters`` (so variants can key the model cache)."""

    def plain(self) -> dict:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in self}


def _rope(rope_type, **extra):
    return Rope({"rope_type": rope_type, "rope_theta": THETA, **extra}.items())


VARIANTS = [
    _llama("default", _rope("default")),
    _llama("linear", _rope("linear", factor=2.0)),
    # dynamic NTK: frequencies change past max_position_embeddings (512 here)
    _llama("dynamic", _rope("dynamic", factor=2.0), max_exact_length=511),
    _llama("llama3", _rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=64)),
    # yarn: attention_scaling = 0.1 ln(factor) + 1
    Variant("yarn", "LlamaConfig", "LlamaForCausalLM",
            (("rope_parameters", _rope("yarn", factor=4.0, original_max_position_embeddings=64)),
             ("max_position_embeddings", 256)),
            attention_scaling=0.1 * math.log(4.0) + 1.0),
    # longrope: short factors up to 256 positions; factor = 512 / 256, so
    # attention_scaling = sqrt(1 + ln(factor) / ln(original_max_position_embeddings))
    _llama("longrope", _rope("longrope", short_factor=tuple(1.0 + 0.1 * i for i in range(HEAD_DIM // 2)),
                             long_factor=tuple(2.0 + 0.1 * i for i in range(HEAD_DIM // 2)),
                             original_max_position_embeddings=256),
           attention_scaling=math.sqrt(1 + math.log(2.0) / math.log(256)), max_exact_length=256),
    Variant("phi-partial", "PhiConfig", "PhiForCausalLM",
            (("rope_parameters", _rope("default", partial_rotary_factor=0.5)),), rotary_dim=8),
    Variant("neox-partial", "GPTNeoXConfig", "GPTNeoXForCausalLM",
            (("rope_parameters", _rope("default", partial_rotary_factor=0.25)),
             ("num_key_value_heads", None)), rotary_dim=4),
    Variant("cohere-interleaved", "CohereConfig", "CohereForCausalLM", (("eos_token_id", 2),), interleaved=True),
]
BY_NAME = {v.name: v for v in VARIANTS}


def _plain(value):
    return value.plain() if isinstance(value, Rope) else value


@lru_cache(maxsize=None)
def build(variant: Variant) -> torch.nn.Module:
    kwargs = dict(TINY)
    for key, value in variant.kwargs:
        if value is None:
            kwargs.pop(key)
        else:
            kwargs[key] = _plain(value)
    config = getattr(transformers, variant.config)(**kwargs)
    torch.manual_seed(0)
    return getattr(transformers, variant.model)(config).eval()
