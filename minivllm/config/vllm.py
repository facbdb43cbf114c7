"""VllmConfig, the one object every constructor receives, and the process-wide current config."""

import contextlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterator

from minivllm.config.cache import CacheConfig
from minivllm.config.compilation import CompilationConfig
from minivllm.config.load import DeviceConfig, LoadConfig
from minivllm.config.model import ModelConfig
from minivllm.config.parallel import ParallelConfig
from minivllm.config.scheduler import SchedulerConfig
from minivllm.config.structured_outputs import StructuredOutputsConfig


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig)
    quant_config: Any = None          # a QuantizationConfig, or None
    lora_config: Any = None
    speculative_config: Any = None
    kernel_config: Any = None

    def __post_init__(self) -> None:
        self.compilation_config.set_default_custom_ops(self.device_config.device)
        verify_parallel_config(self.model_config, self.parallel_config)
        if self.cache_config.sliding_window is None:
            window = getattr(self.model_config.hf_text_config, "sliding_window", None)
            layer_types = getattr(self.model_config.hf_text_config, "layer_types", None)
            # A model-wide window applies only when the config does not assign windows per layer.
            if window and not layer_types and getattr(self.model_config.hf_text_config,
                                                      "use_sliding_window", True):
                self.cache_config.sliding_window = window


def valid_tp_sizes(model_config: ModelConfig) -> list[int]:
    """TP sizes that split heads, KV heads (or replicate them), SSM heads and the padded vocab
    evenly. An attention-free model has only its SSM heads (or its vocab) to split."""
    n_heads = model_config.get_num_attention_heads()
    n_kv = model_config.get_total_num_kv_heads()
    n_ssm = model_config.get_num_ssm_heads()
    padded_vocab = -(-model_config.get_vocab_size() // 64) * 64
    return [t for t in range(1, (n_heads or n_ssm or 8) + 1)
            if (not n_heads or n_heads % t == 0) and (not n_kv or n_kv % t == 0 or t % n_kv == 0)
            and (not n_ssm or n_ssm % t == 0) and padded_vocab % t == 0]


def verify_parallel_config(model_config: ModelConfig, parallel_config: ParallelConfig) -> None:
    """Fail before any model is built when the model cannot be split as asked."""
    tp = parallel_config.tensor_parallel_size
    n_heads = model_config.get_num_attention_heads()
    n_kv = model_config.get_total_num_kv_heads()
    valid = valid_tp_sizes(model_config)
    if tp not in valid:
        n_ssm = model_config.get_num_ssm_heads()
        if n_heads and n_heads % tp:
            what = f"Total number of attention heads ({n_heads})"
        elif n_ssm and n_ssm % tp:
            what = f"Total number of SSM heads ({n_ssm})"
        elif n_kv and n_kv % tp and tp % n_kv:
            what = f"Total number of KV heads ({n_kv})"
        else:
            what = f"Padded vocab size ({-(-model_config.get_vocab_size() // 64) * 64})"
        raise ValueError(f"{what} must be divisible by tensor parallel size ({tp}). "
                         f"Valid tensor_parallel_size values for this model: {valid}")
    pp = parallel_config.pipeline_parallel_size
    n_layers = model_config.get_num_layers()
    if pp > n_layers:
        raise ValueError(f"pipeline_parallel_size ({pp}) is larger than the number of layers "
                         f"({n_layers}); choose a value between 1 and {n_layers}")


_current_vllm_config: VllmConfig | None = None
_current_prefix: str | None = None


@contextlib.contextmanager
def set_current_vllm_config(vllm_config: VllmConfig, check_compile: bool = False,
                            prefix: str | None = None) -> Iterator[None]:
    """Make `vllm_config` the current config while models and layers are constructed."""
    global _current_vllm_config, _current_prefix
    old_config, old_prefix = _current_vllm_config, _current_prefix
    get_cached_compilation_config.cache_clear()
    try:
        _current_vllm_config, _current_prefix = vllm_config, prefix
        yield
        if check_compile:
            vllm_config.compilation_config.custom_op_log_check()
    finally:
        _current_vllm_config, _current_prefix = old_config, old_prefix
        get_cached_compilation_config.cache_clear()


def get_current_vllm_config() -> VllmConfig:
    assert _current_vllm_config is not None, (
        "Current vLLM config is not set. Build models and layers inside "
        "`with set_current_vllm_config(vllm_config):`.")
    return _current_vllm_config


def get_current_vllm_config_or_none() -> VllmConfig | None:
    return _current_vllm_config


@lru_cache(maxsize=1)
def get_cached_compilation_config() -> CompilationConfig:
    return get_current_vllm_config().compilation_config
