"""A real LoRA adapter for the embedded SmolLM2, written by hand (PEFT's on-disk format:
``adapter_config.json`` + ``adapter_model.safetensors``), so tests need neither ``peft`` nor a
model hub. Its B matrices are non-zero, so it changes the keys and values of every layer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj")


def write_adapter(folder: Path, seed: int, model_dir: str | Path, scale: float = 0.05) -> Path:
    """A rank-``RANK`` adapter on every layer's q/k/v projections of the model in ``model_dir``
    (random A and B of std ``scale``, from ``seed``); returns ``folder``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out = {"q_proj": config["num_attention_heads"] * head_dim, "k_proj": config["num_key_value_heads"] * head_dim,
           "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out[target], RANK, generator=generator) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
        "target_modules": list(TARGETS), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "base_model_name_or_path": str(model_dir), "use_rslora": False, "use_dora": False,
    }))
    return folder
