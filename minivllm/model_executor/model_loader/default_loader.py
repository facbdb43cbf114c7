"""Model loaders: build the model, stream the checkpoint into it, check nothing was left out."""

from collections.abc import Iterator

import torch
import torch.nn as nn

from minivllm.config import LoadConfig, ModelConfig, VllmConfig
from minivllm.logger import init_logger
from minivllm.model_executor.model_loader.gguf_loader import (dequantize_for_plain_layers,
                                                              gguf_quant_weights_iterator,
                                                              release_file_pages)
from minivllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from minivllm.model_executor.model_loader.weight_updates import allow_weight_updates
from minivllm.model_executor.model_loader.weight_iterators import (gguf_weights_iterator,
                                                                   safetensors_weights_iterator)
from minivllm.model_executor.models.auto_weights_loader import UnexpectedWeightsError

logger = init_logger(__name__)


class BaseModelLoader:
    """initialize_model -> load_weights -> process_weights_after_loading -> eval()."""

    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig | None = None,
                   prefix: str = "", eagle_head: bool = False) -> nn.Module:
        """`eagle_head`: an EAGLE head, whose embedding and LM head may be missing from its
        checkpoint (`has_own_*` False): the proposer then gives it the target's."""
        model_config = model_config or vllm_config.model_config
        model = initialize_model(vllm_config, prefix=prefix, model_config=model_config)
        self.load_weights(model, model_config, eagle_head)
        process_weights_after_loading(model, model_config, vllm_config.device_config.device)
        if model_config.is_gguf and model_config.quantization == "gguf":
            release_file_pages(model_config.model)
        allow_weight_updates(model)    # later load_weights calls (RLHF) refresh derived copies
        return model.eval()

    def load_weights(self, model: nn.Module, model_config: ModelConfig,
                     eagle_head: bool = False) -> None:
        raise NotImplementedError


class DefaultModelLoader(BaseModelLoader):
    """Reads a HF folder (safetensors or .bin) or a .gguf file."""

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        fmt = self.load_config.load_format
        if model_config.is_gguf:
            if fmt not in ("auto", "gguf"):
                raise ValueError(f"load_format={fmt!r} cannot read the GGUF file {model_config.model!r}; "
                                 "use 'auto' or 'gguf'")
            # quantization="gguf" keeps the blocks packed; "none" dequantises (reference runs).
            if model_config.quantization == "gguf":
                weights = dequantize_for_plain_layers(
                    gguf_quant_weights_iterator(model_config.model, model_config.hf_config),
                    {name for name, _ in model.named_parameters()})
            else:
                weights = gguf_weights_iterator(model_config.model, model_config.hf_config)
        else:
            if fmt == "gguf":
                raise ValueError(f"load_format='gguf' needs a .gguf file, got {model_config.model!r}")
            weights = safetensors_weights_iterator(model_config.model)
        unused = getattr(model, "is_unused_checkpoint_weight", None)
        if callable(unused):
            weights = ((name, w) for name, w in weights if not unused(name))
        return weights

    def load_weights(self, model: nn.Module, model_config: ModelConfig,
                     eagle_head: bool = False) -> None:
        """Load everything; raise ONE ValueError naming every missing and unexpected weight."""
        weights = self.get_all_weights(model_config, model)
        unexpected: list[str] = []
        try:
            loaded = model.load_weights(weights)
        except UnexpectedWeightsError as err:
            loaded, unexpected = err.loaded, err.unexpected
        track = self.load_config.model_loader_extra_config.get(
            "enable_weights_track", getattr(model, "quant_config", None) is None)
        missing: list[str] = []
        if track and loaded is not None:
            missing = sorted(name for name, _ in model.named_parameters() if name not in loaded
                             and not (eagle_head and _shared_from_target(model, name)))
            missing += _missing_shards(model)
        if missing or unexpected:
            raise ValueError(_load_error(type(model).__name__, missing, unexpected))


class DummyModelLoader(BaseModelLoader):
    """Random weights, no checkpoint (benchmarks and tests)."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig,
                     eagle_head: bool = False) -> None:
        initialize_dummy_weights(model, seed=model_config.seed)


def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 1234) -> None:
    """Uniform(low, high) per parameter; a `dummy_weight_value` attribute (RMSNorm: 1.0) wins."""
    with torch.no_grad():
        for param in model.parameters():
            if hasattr(param, "dummy_weight_value"):
                param.fill_(param.dummy_weight_value)
            elif torch.is_floating_point(param):
                generator = torch.Generator(device=param.device).manual_seed(seed)
                if param.element_size() >= 2:
                    param.uniform_(low, high, generator=generator)
                else:   # fp8 and smaller cannot be sampled directly
                    tmp = torch.empty_like(param, dtype=torch.float16).uniform_(low, high, generator=generator)
                    param.copy_(tmp)


def get_model_loader(load_config: LoadConfig) -> BaseModelLoader:
    if load_config.load_format == "dummy":
        return DummyModelLoader(load_config)
    return DefaultModelLoader(load_config)


def get_model(*, vllm_config: VllmConfig, model_config: ModelConfig | None = None, prefix: str = "",
              eagle_head: bool = False) -> nn.Module:
    """Build and load the model described by `vllm_config` (ready for inference, in eval mode)."""
    loader = get_model_loader(vllm_config.load_config)
    return loader.load_model(vllm_config, model_config=model_config, prefix=prefix,
                             eagle_head=eagle_head)


def _shared_from_target(model: nn.Module, name: str) -> bool:
    """An EAGLE head's embedding or LM head its checkpoint did not bring."""
    return (("embed_tokens" in name and not getattr(model, "has_own_embed_tokens", False))
            or ("lm_head" in name and not getattr(model, "has_own_lm_head", False)))


def _missing_shards(model: nn.Module) -> list[str]:
    """'<param> (shard <id>)' for each shard of a fused parameter that loaded only in part."""
    out = []
    for module_name, module in model.named_modules():
        missing_shards = getattr(module, "missing_shards", None)
        if not callable(missing_shards):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            out += [f"{module_name}.{param_name} (shard {shard!r})"
                    for shard in missing_shards(param)]
    return out


def _load_error(model_name: str, missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"Following weights were not initialized from checkpoint: {_listed(missing)}")
    if unexpected:
        parts.append(f"Unexpected checkpoint weights (no such parameter in {model_name}): "
                     f"{_listed(unexpected)}")
    return "; ".join(parts)


def _listed(names: list[str]) -> str:
    return "{" + ", ".join(repr(n) for n in names) + "}" + f" ({len(names)} in all)"
