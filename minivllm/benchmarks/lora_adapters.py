"""Random PEFT LoRA adapters for a Llama-family model, written straight as safetensors.

`bench throughput --num-loras N` needs N adapters for whatever model it runs, also a GGUF file
that PEFT cannot load; the adapters only have to have PEFT's names and the model's shapes, so
they are written directly: `base_model.model.model.layers.<i>.<block>.<proj>.lora_{A,B}.weight`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each Llama linear from the transformers config."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def write_random_adapter(folder: str, hf_config: Any, rank: int, seed: int,
                         target_modules: tuple[str, ...] = ALL_LINEAR) -> str:
    """One rank-`rank` adapter on every layer's `target_modules`; B is non-zero (a trained
    adapter's is), small enough to keep the model's outputs sensible."""
    gen = torch.Generator().manual_seed(seed)
    shapes = linear_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name in target_modules:
            block = "self_attn" if name in ALL_LINEAR[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            out_features, in_features = shapes[name]
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=gen) / in_features ** 0.5)
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_features, rank, generator=gen) * 0.01 / rank ** 0.5)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
              "target_modules": list(target_modules), "modules_to_save": None,
              "use_rslora": False}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return folder
