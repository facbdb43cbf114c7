"""The HF config of a GGUF file's text model, built without importing transformers.

Why: `from transformers import LlamaConfig` costs ~2.3 s and ~80 MB on a cold start (transformers
scans its ~1,700 model files at import, and the config's type validators pull in
`torch.distributed.tensor` and sympy), more than the whole rest of `minivllm generate`.
`HFTextConfig` holds the same fields, with the same defaults and derived values, as transformers'
class for the families listed in `TEXT_CONFIG_DEFAULTS` (tests compare `to_dict()` with
transformers'), and `to_hf()` gives the real transformers config where one is needed.
"""

import copy
import importlib
from typing import Any

__all__ = ["HFTextConfig", "TEXT_CONFIG_DEFAULTS", "make_text_config"]

# Fields every transformers config carries (PreTrainedConfig's own defaults).
_COMMON_DEFAULTS: dict[str, Any] = {
    "architectures": None, "output_hidden_states": False, "output_attentions": False,
    "return_dict": True, "dtype": None, "chunk_size_feed_forward": 0, "is_encoder_decoder": False,
    "id2label": {0: "LABEL_0", 1: "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "problem_type": None, "_name_or_path": "", "hidden_act": "silu", "initializer_range": 0.02,
    "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False, "attention_dropout": 0.0,
    "pad_token_id": None, "num_key_value_heads": None,
}
_QWEN_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 32768, "use_sliding_window": False,
    "num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
    "bos_token_id": None, "eos_token_id": None,
}
# model_type -> (transformers config class, its field defaults beyond _COMMON_DEFAULTS), as in
# transformers 5.x's configuration_<family>.py. `head_dim: None` means hidden_size // heads.
TEXT_CONFIG_DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "max_position_embeddings": 2048, "bos_token_id": 1,
        "eos_token_id": 2, "pretraining_tp": 1, "attention_bias": False, "mlp_bias": False,
        "head_dim": None}),
    "mistral": ("MistralConfig", {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096, "head_dim": None}),
    "qwen2": ("Qwen2Config", _QWEN_DEFAULTS),
    "qwen3": ("Qwen3Config", {**_QWEN_DEFAULTS, "head_dim": 128, "attention_bias": False}),
}
_DEFAULT_ROPE_THETA = 10000.0
_QWEN_WINDOW_TYPES = ("qwen2", "qwen3")      # derive sliding_window and layer_types as Qwen does


class HFTextConfig:
    """Attribute access to a text model's HF config fields, as transformers' config class gives them.

    It has what vLLM and minivllm read from a `PretrainedConfig`: the fields as attributes,
    `model_type`, `architectures`, `name_or_path`, `get_text_config()`, `to_dict()`; it pickles
    (worker processes) and `to_hf()` converts it for code that needs transformers' own class.
    """

    def __init__(self, model_type: str, fields: dict[str, Any]) -> None:
        self.__dict__.update(copy.deepcopy(fields))
        self.model_type = model_type

    @property
    def name_or_path(self) -> str:
        return self._name_or_path

    @name_or_path.setter
    def name_or_path(self, value: str) -> None:
        self._name_or_path = str(value)

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None
                        ) -> "HFTextConfig":
        return self          # a text-only model is its own text config

    def to_dict(self) -> dict[str, Any]:
        """The fields as transformers' `to_dict()` lists them, less `transformers_version`."""
        return copy.deepcopy(self.__dict__)

    def to_hf(self) -> Any:
        """The same config as transformers' own class (imports transformers: ~2 s)."""
        class_name = TEXT_CONFIG_DEFAULTS[self.model_type][0]
        module = importlib.import_module(
            f"transformers.models.{self.model_type}.configuration_{self.model_type}")
        fields = self.to_dict()
        fields.pop("model_type")
        fields["name_or_path"] = fields.pop("_name_or_path")
        return getattr(module, class_name)(**fields)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTextConfig) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        return f"HFTextConfig({self.__dict__!r})"


def make_text_config(model_type: str, **kwargs: Any) -> HFTextConfig:
    """`<Family>Config(**kwargs)` for a family of TEXT_CONFIG_DEFAULTS, without transformers.

    Applies the class's defaults and derived fields (`head_dim`, `num_key_value_heads`, Qwen's
    sliding window and `layer_types`) and moves `rope_theta` into `rope_parameters`.
    """
    if model_type not in TEXT_CONFIG_DEFAULTS:
        raise ValueError(f"No built-in config for model type {model_type!r}; "
                         f"known: {', '.join(sorted(TEXT_CONFIG_DEFAULTS))}")
    fields = {**_COMMON_DEFAULTS, **TEXT_CONFIG_DEFAULTS[model_type][1], **kwargs}
    if "name_or_path" in fields:
        fields["_name_or_path"] = str(fields.pop("name_or_path"))
    heads = fields["num_attention_heads"]
    if fields["hidden_size"] % heads:
        raise ValueError(f"The hidden size ({fields['hidden_size']}) is not a multiple of the number "
                         f"of attention heads ({heads}).")
    if "head_dim" in fields and fields["head_dim"] is None:
        fields["head_dim"] = fields["hidden_size"] // heads
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = heads
    if model_type in _QWEN_WINDOW_TYPES:
        _qwen_layer_types(fields)
    fields["rope_parameters"] = _rope_parameters(fields)
    return HFTextConfig(model_type, fields)


def _qwen_layer_types(fields: dict[str, Any]) -> None:
    # Qwen: the window applies only with use_sliding_window, to layers from max_window_layers on.
    if not fields["use_sliding_window"]:
        fields["sliding_window"] = None
    if fields["layer_types"] is None:
        windowed = fields["sliding_window"] is not None
        fields["layer_types"] = ["sliding_attention" if windowed and i >= fields["max_window_layers"]
                                 else "full_attention" for i in range(fields["num_hidden_layers"])]


def _rope_parameters(fields: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 keeps no `rope_theta` attribute: it lives in rope_parameters.
    rope = dict(fields.pop("rope_parameters", None) or {})
    rope.setdefault("rope_theta", fields.pop("rope_theta", _DEFAULT_ROPE_THETA))
    rope.setdefault("rope_type", "default")
    return rope
