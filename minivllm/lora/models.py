"""LoRAModel: one adapter's weights read from a PEFT folder and matched to the model's layers.

PEFT names a tensor `base_model.model.<module>.lora_A.weight` ([r, in]) or `.lora_B.weight`
([out, r]), where <module> is the transformers module path (`model.layers.0.self_attn.q_proj`).
`LoRATargets` (utils.py) turns that into a LoRA layer of this model and a packed slice
(`...qkv_proj`, slice 0). Weights stay full size on CPU here; each rank's layer keeps its shard
when the adapter is written into a slot.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from minivllm.config.lora import LoRAConfig
from minivllm.lora.peft_helper import PEFTHelper
from minivllm.lora.utils import LoRATargets

_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# <module>.lora_A[.<adapter name>].weight, PEFT's prefix optional
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A|lora_B|"
                  r"lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(?:\.[^.]+)?"
                  r"(?:\.weight)?$")


@dataclass
class LoRALayerWeights:
    """One matrix pair: lora_a [r, in], lora_b [out, r] with the scaling already applied."""

    module_name: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAModel:
    """An adapter: for each LoRA layer (vLLM-side module path) one weight pair per slice."""

    id: int
    rank: int
    loras: dict[str, list[LoRALayerWeights | None]]

    @classmethod
    def from_local_checkpoint(cls, lora_path: str, lora_model_id: int, targets: LoRATargets,
                              lora_config: LoRAConfig) -> LoRAModel:
        peft = PEFTHelper.from_local_dir(lora_path)
        peft.validate(lora_config)
        targets.check_target_modules(peft)
        pairs = _read_pairs(lora_path)
        loras: dict[str, list[LoRALayerWeights | None]] = {}
        unmatched, max_rank = [], 0
        for hf_module, (lora_a, lora_b) in sorted(pairs.items()):
            resolved = targets.resolve(hf_module)
            if resolved is None:
                unmatched.append(hf_module)
                continue
            if resolved is LoRATargets.NOT_ON_THIS_RANK:
                continue
            module_name, slice_index = resolved
            rank = lora_a.shape[0]
            max_rank = max(max_rank, rank)
            if rank > lora_config.max_lora_rank:
                raise ValueError(f"LoRA rank {rank} of {hf_module} is greater than "
                                 f"max_lora_rank {lora_config.max_lora_rank}; raise "
                                 "--max-lora-rank")
            b = lora_b.float() * peft.scaling(hf_module)
            _place(loras, targets, module_name, slice_index,
                   LoRALayerWeights(hf_module, lora_a.float(), b))
        if unmatched:
            raise ValueError(f"LoRA adapter {lora_path!r} has weights for modules this model "
                             f"cannot adapt: {', '.join(unmatched)}; valid target modules: "
                             f"{', '.join(targets.valid_target_names)}")
        return cls(lora_model_id, max_rank, loras)


def _place(loras: dict[str, list[LoRALayerWeights | None]], targets: LoRATargets,
           module_name: str, slice_index: int | None, weights: LoRALayerWeights) -> None:
    """Put one pair at its slice; a whole fused matrix (slice None) is split into its slices,
    which then share one A."""
    layer = targets.lora_modules[module_name]
    slots = loras.setdefault(module_name, [None] * layer.num_slices)
    if slice_index is not None:
        slots[slice_index] = weights
        return
    sizes = layer.global_slice_sizes()
    if weights.lora_b.shape[0] != sum(sizes):
        raise ValueError(f"{weights.module_name}.lora_B has {weights.lora_b.shape[0]} rows, "
                         f"the layer {module_name} has {sum(sizes)}")
    for k, b in enumerate(weights.lora_b.split(sizes)):
        slots[k] = LoRALayerWeights(weights.module_name, weights.lora_a, b)


def _read_pairs(lora_path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (lora_A, lora_B), refusing tensors that are not LoRA pairs."""
    tensors = _load_tensors(lora_path)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {lora_path!r}: unexpected tensor {key!r} (only "
                             "lora_A / lora_B weights are supported)")
        kind = match["kind"]
        if kind not in ("lora_A", "lora_B"):
            raise ValueError(f"LoRA adapter {lora_path!r}: {key!r} is a {kind} tensor; "
                             "embedding LoRA and DoRA are not supported")
        parts.setdefault(match["module"], {})[kind] = tensor
    pairs = {}
    for module, kinds in parts.items():
        if set(kinds) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(kinds)).pop()
            raise ValueError(f"LoRA adapter {lora_path!r}: {module} has no {missing} weight")
        a, b = kinds["lora_A"], kinds["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {lora_path!r}: {module} lora_A {tuple(a.shape)} and "
                             f"lora_B {tuple(b.shape)} are not [r, in] and [out, r]")
        pairs[module] = (a, b)
    return pairs


def _load_tensors(lora_path: str) -> dict[str, torch.Tensor]:
    for name in _WEIGHT_FILES:
        path = os.path.join(lora_path, name)
        if not os.path.isfile(path):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(path)
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:   # SafetensorError, UnpicklingError, EOFError, ...: no ValueError
            raise ValueError(f"LoRA adapter {lora_path!r}: {name} is not a readable weights "
                             f"file ({type(exc).__name__}: {exc})") from exc
    raise ValueError(f"No adapter weights in {lora_path!r}: expected one of "
                     f"{', '.join(_WEIGHT_FILES)}")
