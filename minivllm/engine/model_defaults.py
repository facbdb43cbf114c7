"""Model-dependent defaults `EngineArgs.create_engine_config` applies: a pooling model's step
limits and pooling type, and prefix caching off where a model cannot use it."""

from typing import Any

from minivllm.config import ModelConfig
from minivllm.config.pooler import resolve_pooler_config
from minivllm.logger import init_logger
from minivllm.model_executor.models.registry import ModelRegistry

logger = init_logger(__name__)


def step_limits(model_config: ModelConfig, max_num_batched_tokens: int,
                 max_num_seqs: int) -> tuple[int, int]:
    """(token budget, sequences) of a step. A pooling model whose attention sees the whole
    sequence cannot prefill a prompt in chunks (a chunk would not see the later ones): each step
    then runs one whole prompt (the scheduler gives a second request the budget's rest)."""
    bidirectional = getattr(model_config.hf_config, "is_causal", True) is False or \
        any("Bidirectional" in arch for arch in model_config.architectures) or \
        _encoder_only(model_config)
    if model_config.runner_type != "pooling" or not bidirectional:
        return max_num_batched_tokens, max_num_seqs
    logger.info("%s attends bidirectionally: one whole prompt per step (token budget "
                "max_model_len=%d)", model_config.architectures, model_config.max_model_len)
    return max(max_num_batched_tokens, model_config.max_model_len), 1


def prefix_caching(asked: bool, model_config: ModelConfig) -> bool:
    """Off for pooling models (a pooling prompt's every hidden state is needed) and hybrid ones
    (a cached prefix would skip building their layers' recurrent state)."""
    if not asked or model_config.runner_type == "pooling":
        return False
    try:
        hybrid = ModelRegistry.model_has_inner_state(model_config.architectures)
    except ValueError:      # an architecture not registered (yet): the loader names it later
        hybrid = False
    if hybrid:
        logger.info("Prefix caching is off: %s keeps recurrent state per sequence",
                    model_config.architectures[0])
        return False
    return True


def _pooling_model_cls(model_config: ModelConfig) -> type | None:
    """The registered class a pooling model runs (adapted when converted), else None."""
    if model_config.runner_type != "pooling":
        return None
    try:
        return ModelRegistry.resolve_model_cls(model_config.architectures, model_config)[0]
    except ValueError:      # not registered (yet): `check_pooling_model` names it
        return None


def apply_class_pooling_default(model_config: ModelConfig, user: Any) -> None:
    """vLLM's per-class default pooling (`@default_pooling_type`: BERT pools CLS) where neither
    the user, a sentence-transformers file nor the HF config names one (before the engine runs)."""
    default = getattr(_pooling_model_cls(model_config), "default_seq_pooling_type", "LAST")
    if default != "LAST":
        model_config.pooler_config = resolve_pooler_config(user, model_config.model,
                                                           model_config.hf_config, default)


def _encoder_only(model_config: ModelConfig) -> bool:
    """As vLLM's `ModelConfig.attn_type`: a pooling class that pools CLS by default, or one
    marked `@attn_type("encoder_only")`, attends bidirectionally."""
    cls = _pooling_model_cls(model_config)
    return (getattr(cls, "default_seq_pooling_type", "LAST") == "CLS"
            or getattr(cls, "attn_type", "decoder") == "encoder_only")


def check_pooling_model(model_config: ModelConfig) -> None:
    """The pooling runner without a conversion needs a model that has a pooler."""
    if model_config.runner_type != "pooling" or model_config.convert_type != "none":
        return
    if not ModelRegistry.is_pooling_model(model_config.architectures):
        raise ValueError(f"{model_config.architectures} is not a pooling model; add --convert "
                         "embed to pool its hidden states into embeddings")
