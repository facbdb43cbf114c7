"""Loading Hugging Face configs (folders and GGUF files) and normalising their RoPE fields."""

import importlib
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from huggingface_hub.errors import StrictDataclassError

from minivllm.transformers_utils.gguf_file import GGUFFile, open_gguf
from minivllm.transformers_utils.hf_config import TEXT_CONFIG_DEFAULTS, HFTextConfig, make_text_config

if TYPE_CHECKING:     # transformers costs ~1 s to import; GGUF runs of known families skip it
    from transformers import PretrainedConfig

# llama.cpp architecture -> (transformers model folder, config class, HF architecture name).
_GGUF_ARCHS = {"llama": ("llama", "LlamaConfig", "LlamaForCausalLM"),
               "mistral": ("mistral", "MistralConfig", "MistralForCausalLM"),
               "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
               "gemma": ("gemma", "GemmaConfig", "GemmaForCausalLM"),
               "gemma2": ("gemma2", "Gemma2Config", "Gemma2ForCausalLM"),
               "gemma3": ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM"),
               "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM"),
               "qwen3moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
               "qwen2moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
               # llama.cpp writes Mixtral as "llama" with experts (see _gguf_arch)
               "mixtral": ("mixtral", "MixtralConfig", "MixtralForCausalLM"),
               # DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash: the V3 routing comes as config fields
               "deepseek2": ("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM"),
               "lfm2": ("lfm2", "Lfm2Config", "Lfm2ForCausalLM")}
# `<arch>.<key>` metadata -> config field, as transformers' GGUF loader maps them. Qwen's
# rope.dimension_count is not its head_dim (transformers skips it there too).
_GGUF_ARCH_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
}
_GGUF_HEAD_DIM_ARCHS = ("llama", "mistral")
# Per-architecture `<arch>.<key>` -> config field beyond the common ones. llama.cpp states the
# head size as the key length (Qwen3's and Gemma's need not be hidden / heads).
_GGUF_FAMILY_KEYS = {
    "qwen3": {"attention.key_length": "head_dim"},
    "gemma": {"attention.key_length": "head_dim"},
    "gemma2": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window",
               "attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "gemma3": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"},
    "phi3": {"attention.sliding_window": "sliding_window",
             "rope.scaling.original_context_length": "original_max_position_embeddings"},
    "qwen3moe": {"attention.key_length": "head_dim", "expert_count": "num_experts",
                 "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "mixtral": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    "lfm2": {"shortconv.l_cache": "conv_L_cache"},
    "deepseek2": {"attention.q_lora_rank": "q_lora_rank", "attention.kv_lora_rank": "kv_lora_rank",
                  "rope.dimension_count": "qk_rope_head_dim", "expert_count": "n_routed_experts",
                  "expert_used_count": "num_experts_per_tok",
                  "expert_shared_count": "n_shared_experts",
                  "expert_feed_forward_length": "moe_intermediate_size",
                  "leading_dense_block_count": "first_k_dense_replace",
                  "expert_weights_scale": "routed_scaling_factor",
                  "expert_weights_norm": "norm_topk_prob", "expert_group_count": "n_group",
                  "expert_group_used_count": "topk_group"},
}
# Fields llama.cpp's graph fixes without storing them: Qwen3-MoE always renormalises its top-k,
# Qwen2-MoE never does.
_GGUF_FAMILY_DEFAULTS = {"qwen3moe": {"norm_topk_prob": True},
                         "qwen2moe": {"norm_topk_prob": False}}
_GGUF_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
                   "unknown_token_id": "unk_token_id", "padding_token_id": "pad_token_id"}


def is_gguf(model: str) -> bool:
    return os.path.isfile(model) and model.endswith(".gguf")


def get_config(model: str, trust_remote_code: bool = False,
               hf_overrides: "dict[str, Any] | Callable | None" = None
               ) -> "PretrainedConfig | HFTextConfig":
    """Read the HF config of a checkpoint folder or of a `.gguf` file's metadata, then lay
    `hf_overrides` over it (vLLM's: a dict, nested dicts merged into sub-configs, or a
    function config -> config). `trust_remote_code` lets transformers run the folder's own
    configuration code."""
    if is_gguf(model):
        config = _gguf_config(model)
    elif os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"{model!r} has no config.json; pass a HF checkpoint folder or a .gguf file")
        config = _folder_config(model, trust_remote_code)
    else:
        raise ValueError(f"Model path {model!r} is neither a folder nor a .gguf file "
                         "(minivllm never downloads from a hub)")
    if hf_overrides:
        config = hf_overrides(config) if callable(hf_overrides) else \
            _override(config, hf_overrides)
    patch_rope_parameters(config)
    return config


def _override(config: Any, overrides: dict[str, Any]) -> Any:
    """Sets each key on `config`; a dict given for a sub-config (text_config) is merged into
    it key by key, one given for a dict-valued field (rope_scaling) updates that dict."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and current is not None and hasattr(current, "to_dict"):
            _override(current, value)
        elif isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, {**current, **value})
        else:
            setattr(config, key, value)
    return config


def _folder_config(model: str, trust_remote_code: bool = False) -> "PretrainedConfig":
    """AutoConfig's reading of a folder, or one of `configs.CONFIG_REGISTRY`'s classes for the
    model types transformers does not know (legacy Falcon's "RefinedWeb")."""
    with open(os.path.join(model, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    from minivllm.transformers_utils.configs import CONFIG_REGISTRY

    if model_type in CONFIG_REGISTRY:
        return CONFIG_REGISTRY[model_type].from_pretrained(model)
    # Imported here for start-up time: the auto tables cost ~0.3 s and GGUF runs skip them.
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)


def gguf_config_dict(gguf_file: GGUFFile) -> dict[str, Any]:
    """The config fields llama.cpp's metadata states, named as transformers' GGUF loader names them."""
    meta, arch = gguf_file.metadata, gguf_file.architecture
    family = _gguf_arch(gguf_file)            # the metadata keys stay under `arch`
    keys = dict(_GGUF_ARCH_KEYS)
    if arch in _GGUF_HEAD_DIM_ARCHS:
        keys["rope.dimension_count"] = "head_dim"
    keys.update(_GGUF_FAMILY_KEYS.get(family, {}))
    # llama.cpp writes output.weight only when it is not the embedding matrix.
    fields: dict[str, Any] = {"tie_word_embeddings": gguf_file.get_tensor("output.weight") is None,
                              **_GGUF_FAMILY_DEFAULTS.get(family, {})}
    if "general.name" in meta:
        fields["_model_name_or_path"] = meta["general.name"]
    fields.update({name: meta[f"{arch}.{key}"] for key, name in keys.items() if f"{arch}.{key}" in meta})
    fields.update({name: meta[f"tokenizer.ggml.{key}"] for key, name in _GGUF_TOKEN_IDS.items()
                   if f"tokenizer.ggml.{key}" in meta})
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in meta:
        fields["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    if arch in ("gemma2", "gemma3"):
        _gemma_gguf_fields(meta, arch, fields)
    if arch == "deepseek2":
        _deepseek2_gguf_fields(gguf_file, fields)
    if arch == "lfm2":
        _lfm2_gguf_fields(fields)
    if arch == "phi3" and gguf_file.get_tensor("rope_factors_long.weight") is not None:
        fields["rope_parameters"] = _longrope_parameters(gguf_file, fields)
    return fields


def _gguf_arch(gguf_file: GGUFFile) -> str:
    """The family of a file: its architecture, except that llama.cpp's Mixtral is "llama" with
    an expert count."""
    arch = gguf_file.architecture
    if arch == "llama" and gguf_file.metadata.get("llama.expert_count", 0) > 0:
        return "mixtral"
    return arch


def _longrope_parameters(gguf_file: GGUFFile, fields: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE: llama.cpp keeps the per-frequency factors as two F32 tensors."""
    factors = {kind: [float(x) for x in gguf_file.get_tensor(f"rope_factors_{kind}.weight").data]
               for kind in ("long", "short")}
    return {"rope_type": "longrope", "rope_theta": fields.pop("rope_theta", 10000.0),
            "long_factor": factors["long"], "short_factor": factors["short"],
            "original_max_position_embeddings": fields.get("original_max_position_embeddings")}


def _lfm2_gguf_fields(fields: dict[str, Any]) -> None:
    """LFM2: llama.cpp marks the conv layers by a KV head count of 0 (one count per layer),
    states the MLP width already adjusted, and keeps the norm epsilon as the RMS one."""
    kv_heads = fields.get("num_key_value_heads")
    if kv_heads is not None and not isinstance(kv_heads, int):     # an array, one per layer
        kv_heads = [int(n) for n in kv_heads]
        fields["layer_types"] = ["full_attention" if n else "conv" for n in kv_heads]
        fields["num_key_value_heads"] = max(kv_heads)
    fields["block_auto_adjust_ff_dim"] = False
    if "rms_norm_eps" in fields:
        fields["norm_eps"] = fields.pop("rms_norm_eps")


# llama.cpp's expert_gating_func values
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def _deepseek2_gguf_fields(gguf_file: GGUFFile, fields: dict[str, Any]) -> None:
    """DeepSeek's head sizes, routing and YaRN from llama.cpp's keys. Newer converters state
    the MQA view of MLA as key/value_length (latent sizes) and the per-head sizes as *_mla."""
    meta, key = gguf_file.metadata, "deepseek2.attention."
    fields.setdefault("q_lora_rank", None)              # no key: queries straight from x
    rope = fields["qk_rope_head_dim"]
    key_length = meta.get(key + "key_length_mla", meta.get(key + "key_length"))
    fields["qk_nope_head_dim"] = key_length - rope
    fields["v_head_dim"] = meta.get(key + "value_length_mla", meta.get(key + "value_length"))
    fields["num_key_value_heads"] = fields["num_attention_heads"]   # the MQA view says 1
    gating = _GGUF_GATING[meta.get("deepseek2.expert_gating_func", 1)]
    fields["scoring_func"] = gating
    grouped = (fields.get("n_group") or 1) > 1
    fields["topk_method"] = ("noaux_tc" if gating == "sigmoid"
                             else "group_limited_greedy" if grouped else "greedy")
    if meta.get("deepseek2.rope.scaling.type") == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim; DeepSeek's configs set mscale to the same.
        mscale = float(meta.get("deepseek2.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        fields["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": fields.pop("rope_theta", 10000.0),
            "factor": float(meta["deepseek2.rope.scaling.factor"]),
            "original_max_position_embeddings":
                int(meta["deepseek2.rope.scaling.original_context_length"]),
            "mscale": mscale, "mscale_all_dim": mscale, "beta_fast": 32, "beta_slow": 1}


_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_gguf_fields(meta: dict[str, Any], arch: str, fields: dict[str, Any]) -> None:
    """What llama.cpp's Gemma 2/3 graphs fix instead of storing: queries scaled by the head size
    (by hidden / heads for the 27B models, which llama.cpp knows by their layer count), Gemma 3's
    local layers at RoPE base 10000 (the config class's default), its layer pattern."""
    if fields.get("num_hidden_layers") == _GEMMA_27B_LAYERS[arch]:
        fields["query_pre_attn_scalar"] = fields["hidden_size"] // fields["num_attention_heads"]
    elif "head_dim" in fields:
        fields["query_pre_attn_scalar"] = fields["head_dim"]
    if arch != "gemma3":
        return
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        fields["rope_parameters"] = {
            "full_attention": {"rope_type": "linear", "rope_theta": fields.pop("rope_theta", 1e6),
                               "factor": float(meta[f"{arch}.rope.scaling.factor"])},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None and "num_hidden_layers" in fields:
        # Either one flag per layer (True = local) or "every n-th layer is global".
        flags = ([bool(p) for p in pattern] if not isinstance(pattern, int) else
                 [(i + 1) % pattern != 0 for i in range(fields["num_hidden_layers"])])
        fields["layer_types"] = ["sliding_attention" if f else "full_attention" for f in flags]


def _gguf_config(path: str) -> "PretrainedConfig | HFTextConfig":
    path = os.path.abspath(path)
    gguf_file = open_gguf(path)
    arch = _gguf_arch(gguf_file)
    if arch not in _GGUF_ARCHS:
        # Other architectures: transformers' own (slower) GGUF conversion, when it knows them.
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        if not getattr(config, "architectures", None):
            config.architectures = [config.model_type]
        return config
    folder, class_name, hf_arch = _GGUF_ARCHS[arch]
    if folder in TEXT_CONFIG_DEFAULTS:
        config = make_text_config(folder, **gguf_config_dict(gguf_file))
    else:
        # Only this family's config module: `AutoConfig` would import every family's table.
        module = importlib.import_module(f"transformers.models.{folder}.configuration_{folder}")
        config = getattr(module, class_name)(**gguf_config_dict(gguf_file))
    config.architectures = [hf_arch]
    config.name_or_path = os.path.dirname(path)       # what AutoConfig(gguf_file=) records
    return config


def patch_rope_parameters(config: "PretrainedConfig") -> None:
    """Deliver `config.rope_parameters` (with `rope_theta` inside) as vLLM does (contract §7.3)."""
    for cfg in _configs_to_patch(config):
        _patch_one(cfg)


def _configs_to_patch(config: "PretrainedConfig") -> list["PretrainedConfig"]:
    configs = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        configs.append(text)
    return configs


def _rope_type_alias(rope_type: str) -> str:
    """The RoPE type an old spelling names (`su` LongRoPE, `mrope`: default frequencies whose
    sections `mrope_section` gives)."""
    return {"su": "longrope", "mrope": "default"}.get(rope_type, rope_type)


def _patch_one(cfg: "PretrainedConfig") -> None:
    # Legacy attribute names used by older checkpoints.
    if getattr(cfg, "rotary_emb_base", None) is not None and getattr(cfg, "rope_theta", None) is None:
        cfg.rope_theta = cfg.rotary_emb_base
    rope: dict[str, Any] | None = getattr(cfg, "rope_parameters", None)
    if rope is None:
        rope = getattr(cfg, "rope_scaling", None)
    rope = dict(rope) if rope else {}
    per_layer_type = bool(rope) and all(isinstance(v, dict) for v in rope.values())
    if "type" in rope:
        legacy = rope.pop("type")
        # transformers 5 keeps a legacy {"type": "mrope"} (Qwen2-VL / Qwen2.5-VL configs) beside
        # the "rope_type": "default" it derives: the same type once both are normalised.
        current = rope.get("rope_type")
        if current is not None and _rope_type_alias(current) != _rope_type_alias(legacy):
            raise ValueError(f"rope_parameters has conflicting 'type'={legacy!r} and "
                             f"'rope_type'={rope['rope_type']!r}")
        rope["rope_type"] = legacy
    rope["rope_type"] = _rope_type_alias(rope.get("rope_type", "default"))
    if "rope_theta" not in rope and getattr(cfg, "rope_theta", None) is not None:
        rope["rope_theta"] = cfg.rope_theta
    for legacy_name in ("partial_rotary_factor", "rotary_pct"):
        value = getattr(cfg, legacy_name, None)
        if value is not None and "partial_rotary_factor" not in rope:
            rope["partial_rotary_factor"] = value
    if rope.get("partial_rotary_factor") == 1.0:
        rope.pop("partial_rotary_factor")
    if rope.get("rope_theta") is None and len(rope) <= 1:
        rope = None
        if not hasattr(cfg, "rope_parameters"):
            # As vLLM: a config without RoPE fields stays without the attribute (vLLM's GPT-J
            # reads `getattr(config, "rope_parameters", {})` and fills it in).
            return
    try:
        cfg.rope_parameters = rope
    except StrictDataclassError:
        # NOTE: a config class typing rope_parameters as {layer type: {...}} (ModernBERT) refuses
        # the top-level keys added above; its per-type entries are complete, so keep them as is.
        if not per_layer_type:
            raise


def set_default_rope_theta(config: "PretrainedConfig", default_theta: float) -> None:
    """Qwen's default: make sure `rope_parameters` exists and carries a theta."""
    if getattr(config, "rope_parameters", None) is None:
        config.rope_parameters = {"rope_type": "default"}
    if "rope_theta" not in config.rope_parameters:
        config.rope_parameters["rope_theta"] = default_theta
