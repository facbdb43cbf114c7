"""`DoryConfig`: Dory's config as its checkpoints lay it out (vLLM's `configs/dory.py` reading).

A Dory checkpoint stores each decoder layer as two blocks, an attention block then an MLP block:
`layer_types` has one entry per block ("sliding_attention" / "full_attention" / "mlp") and
`num_hidden_layers`, `n_input_layers`, `n_recurrent_layers`, `n_output_layers` count blocks.
transformers' own DoryConfig folds each pair into one layer (halving those counts), which is not
what vLLM's dory.py builds from, so this class keeps the checkpoint's counts as they are.
The `n_recurrent_layers` middle blocks run `n_recurrent_loops` times.
"""

from huggingface_hub.dataclasses import strict
from transformers import PretrainedConfig

BLOCK_TYPES = ("sliding_attention", "full_attention", "mlp")
RECURRENT_KV_CACHE_MODES = ("per_loop", "last_loop")


# A strict dataclass as transformers 5's configs are: its `validate_*` methods replace the base
# class's checks (which know no "mlp" blocks) and run on construction and from `validate()`.
@strict
class DoryConfig(PretrainedConfig):
    model_type = "dory"
    default_theta = 10_000.0

    vocab_size: int = 131072
    hidden_size: int = 2560
    num_hidden_layers: int = 72                 # blocks, not attention + MLP pairs
    intermediate_size: int = 7168
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02            # also rescales the learned nGPT alphas
    sliding_window: int | None = 1024
    rope_parameters: dict | None = None          # {"sliding_attention": {...}, ...}
    layer_types: list[str] | None = None
    ngpt_alpha_init: float = 0.05
    attention_output_gate_logit_scale_init: float | None = None
    mlp_bias: bool = False
    attention_bias: bool = False
    n_input_layers: int = 0
    n_recurrent_layers: int | None = None
    n_output_layers: int = 0
    n_recurrent_loops: int = 1
    recurrent_kv_cache_mode: str = "per_loop"  # "last_loop": one cache, rewritten each loop

    def __post_init__(self, **kwargs) -> None:
        if self.layer_types is None:    # the released layout: every eighth block global
            self.layer_types = [
                "mlp" if i % 2 else "full_attention" if i % 8 == 6 else "sliding_attention"
                for i in range(self.num_hidden_layers)]
        if self.rope_parameters is None:
            self.rope_parameters = {kind: {"rope_type": "default"}
                                    for kind in ("sliding_attention", "full_attention")
                                    if kind in self.layer_types}
        if self.n_recurrent_layers is None:
            self.n_recurrent_layers = (self.num_hidden_layers - self.n_input_layers
                                       - self.n_output_layers)
        super().__post_init__(**kwargs)

    def validate_layer_type(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers or any(
                kind not in BLOCK_TYPES for kind in self.layer_types):
            raise ValueError(f"layer_types must list num_hidden_layers ({self.num_hidden_layers}) "
                             f"blocks, each one of {', '.join(BLOCK_TYPES)}")

    def validate_architecture(self) -> None:
        parts = (self.n_input_layers, self.n_recurrent_layers, self.n_output_layers)
        if min(parts) < 0 or sum(parts) != self.num_hidden_layers:
            raise ValueError(f"n_input_layers + n_recurrent_layers + n_output_layers {parts} "
                             f"must sum to num_hidden_layers ({self.num_hidden_layers})")
        if self.n_recurrent_loops < 1:
            raise ValueError(f"n_recurrent_loops must be >= 1, got {self.n_recurrent_loops}")
        if self.recurrent_kv_cache_mode not in RECURRENT_KV_CACHE_MODES:
            raise ValueError(f"recurrent_kv_cache_mode must be one of "
                             f"{', '.join(RECURRENT_KV_CACHE_MODES)}, got "
                             f"{self.recurrent_kv_cache_mode!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.attention_bias or self.mlp_bias or self.hidden_act != "silu" \
                or self.tie_word_embeddings:
            raise ValueError("Dory takes bias-free projections, hidden_act 'silu' and untied "
                             "embeddings")

    def validate_rope(self) -> None:
        """One default RoPE per attention block type: {"sliding_attention": {...}, ...}."""
        missing = {k for k in self.layer_types if k != "mlp"} - set(self.rope_parameters)
        if missing:
            raise ValueError(f"rope_parameters needs an entry for {sorted(missing)}")
