"""`RWConfig`: the config of the first Falcon checkpoints ("RefinedWeb" / "RefinedWebModel",
e.g. falcon-7b and falcon-40b before transformers had Falcon), read under transformers'
Falcon field names so one model file serves both kinds of config.

Their config.json names heads and layers `n_head`, `n_layer`, `n_head_kv` (KV heads, 1 when
absent: multi-query) and the width `hidden_size` or `n_embed`; falcon-40b's file states no
`new_decoder_architecture`, so an 8192-wide model is taken to have it. RoPE (base 10000)
unless `alibi`.
"""

from transformers import PretrainedConfig


class RWConfig(PretrainedConfig):
    model_type = "falcon"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "num_kv_heads": "n_head_kv"}

    def __init__(self, vocab_size: int = 250880, hidden_size: int = 64, n_layer: int = 2,
                 n_head: int = 8, layer_norm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_cache: bool = True, bos_token_id: int = 1,
                 eos_token_id: int = 2, hidden_dropout: float = 0.0,
                 attention_dropout: float = 0.0, multi_query: bool = True,
                 n_head_kv: int | None = None, alibi: bool = False, bias: bool = False,
                 parallel_attn: bool = False, new_decoder_architecture: bool = False,
                 **kwargs) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = kwargs.pop("n_embed", None) or hidden_size
        self.n_layer, self.n_head = n_layer, n_head
        self.n_head_kv = 1 if n_head_kv is None else n_head_kv
        self.layer_norm_epsilon, self.initializer_range = layer_norm_epsilon, initializer_range
        self.use_cache = use_cache
        self.hidden_dropout, self.attention_dropout = hidden_dropout, attention_dropout
        self.multi_query, self.alibi, self.bias = multi_query, alibi, bias
        self.parallel_attn = parallel_attn
        self.new_decoder_architecture = new_decoder_architecture or self.hidden_size == 8192
        # The RefinedWeb models' RoPE: base 10000 (their files state none).
        self.rope_parameters = kwargs.pop("rope_parameters", None) or {
            "rope_type": "default", "rope_theta": kwargs.pop("rope_theta", 10000.0)}
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_head

    @property
    def rotary(self) -> bool:
        return not self.alibi
