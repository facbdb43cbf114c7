"""Llama, written to vLLM's model-file contract (the reference model file)."""

from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING

import torch
from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import CacheConfig, VllmConfig
from minivllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from minivllm.model_executor.layers.activation import SiluAndMul
from minivllm.model_executor.layers.attention import Attention, EncoderOnlyAttention
from minivllm.model_executor.layers.fusion.fused_act_quant import maybe_fused_act_quant
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope
from minivllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding)
from minivllm.model_executor.parameter import set_weight_attrs, sharded_weight_loader
from minivllm.sequence import IntermediateTensors
from minivllm.v1.attention.backend import AttentionType

from .adapters import as_embedding_model, as_seq_cls_model
from .interfaces import (EagleModelMixin, LocalArgmaxMixin, SupportsEagle, SupportsEagle3,
                         SupportsLoRA, SupportsPP, SupportsQuant)
from .utils import (AutoWeightsLoader, PPMissingLayer, WeightsMapper, extract_layer_index,
                    make_empty_intermediate_tensors_factory, make_layers, maybe_prefix,
                    spec_decode_needs_target_embed)

if TYPE_CHECKING:     # annotations only: importing transformers costs ~2 s of cold start
    from transformers import LlamaConfig


class LlamaMLP(nn.Module):
    """gate_up (merged column) -> SiLU(gate) * up -> down (row)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 quant_config: QuantizationConfig | None = None, bias: bool = False,
                 prefix: str = "", reduce_results: bool = True, disable_tp: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            input_size=hidden_size, output_sizes=[intermediate_size] * 2, bias=bias,
            quant_config=quant_config, disable_tp=disable_tp, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(
            input_size=intermediate_size, output_size=hidden_size, bias=bias,
            quant_config=quant_config, reduce_results=reduce_results, disable_tp=disable_tp,
            prefix=f"{prefix}.down_proj")
        if hidden_act != "silu":
            raise ValueError(f"Unsupported activation: {hidden_act} (config field hidden_act); "
                             "LlamaMLP supports silu only")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.gate_up_proj(x)                        # [T, 2 * I / TP]
        x = maybe_fused_act_quant(self.act_fn, x, self.down_proj)   # [T, I / TP]
        x, _ = self.down_proj(x)                           # [T, H], all-reduced
        return x


class LlamaAttention(nn.Module):
    """QKV projection -> RoPE -> paged attention -> output projection, for this TP rank's heads."""

    def __init__(self, config: "LlamaConfig", hidden_size: int, num_heads: int, num_kv_heads: int,
                 max_position_embeddings: int = 8192, quant_config: QuantizationConfig | None = None,
                 bias: bool = False, bias_o_proj: bool = False, cache_config: CacheConfig | None = None,
                 prefix: str = "", attn_type: str = AttentionType.DECODER) -> None:
        super().__init__()
        layer_idx = self.layer_idx = extract_layer_index(prefix)
        self.hidden_size = hidden_size
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = num_heads
        assert self.total_num_heads % tp_size == 0
        self.num_heads = self.total_num_heads // tp_size
        self.total_num_kv_heads = num_kv_heads
        # KV heads are split when there are at least TP of them, otherwise replicated.
        if self.total_num_kv_heads >= tp_size:
            assert self.total_num_kv_heads % tp_size == 0
        else:
            assert tp_size % self.total_num_kv_heads == 0
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.max_position_embeddings = max_position_embeddings

        self.qkv_proj = QKVParallelLinear(
            hidden_size=hidden_size, head_size=self.head_dim, total_num_heads=self.total_num_heads,
            total_num_kv_heads=self.total_num_kv_heads, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(
            input_size=self.total_num_heads * self.head_dim, output_size=hidden_size,
            bias=bias_o_proj, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self._init_rotary_emb(config, quant_config=quant_config)

        sliding_window = None
        if layer_types := getattr(config, "layer_types", None):
            # An EAGLE-3 draft's layers are named past the target's (layers.{L + i}); its
            # layer_types count from its own first layer.
            effective_idx = layer_idx - getattr(config, "target_layer_count", 0)
            if layer_types[effective_idx] == "sliding_attention":
                sliding_window = config.sliding_window
        attn_cls = EncoderOnlyAttention if attn_type == AttentionType.ENCODER_ONLY else Attention
        sinks = self._make_sinks(config, layer_idx)
        extra = {} if sinks is None else {"sinks": sinks}
        self.attn = attn_cls(self.num_heads, self.head_dim, self.scaling,
                             num_kv_heads=self.num_kv_heads, cache_config=cache_config,
                             quant_config=quant_config, per_layer_sliding_window=sliding_window,
                             attn_type=attn_type, prefix=f"{prefix}.attn", **extra)

    def _make_sinks(self, config: "LlamaConfig", layer_idx: int) -> nn.Parameter | None:
        """Attention sinks [num_heads / TP] (one learned logit per head in every softmax
        denominator), registered as `self.sinks`; None (Llama) for none. Families with sinks
        override this hook, which runs before `attn` is built."""
        return None

    def _register_sinks(self) -> nn.Parameter:
        """`self.sinks` [num_heads / TP], loaded as this rank's heads of the checkpoint's."""
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        set_weight_attrs(self.sinks, {"weight_loader": sharded_weight_loader(0)})
        return self.sinks

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)              # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_emb is not None:                    # None: a position-free (NoPE) layer
            q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)                   # [T, q_size]
        output, _ = self.o_proj(attn_output)               # [T, H]
        return output

    def _init_rotary_emb(self, config: "LlamaConfig", quant_config: QuantizationConfig | None) -> None:
        self.rotary_emb = get_rope(self.head_dim, max_position=self.max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None),
                                   is_neox_style=True)


def input_norm(norm: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's first norm: (normed, residual); the first layer starts the residual stream."""
    if residual is None:
        return norm(hidden_states), hidden_states
    return norm(hidden_states, residual)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream stays outside the norms (fused add + RMSNorm)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config: "LlamaConfig | None" = None,
                 attn_layer_type: type[nn.Module] = LlamaAttention) -> None:
        super().__init__()
        config = config or vllm_config.model_config.hf_config
        cache_config = vllm_config.cache_config
        quant_config = self.get_quant_config(vllm_config)
        self.hidden_size = config.hidden_size
        max_position_embeddings = getattr(config, "max_position_embeddings", 8192)
        attention_bias = getattr(config, "attention_bias", False) or getattr(config, "bias", False)
        bias_o_proj = attention_bias
        if hasattr(config, "qkv_bias"):        # InternLM3 sets q/k/v bias on its own
            attention_bias = config.qkv_bias
        attn_type = AttentionType.DECODER if getattr(config, "is_causal", True) \
            else AttentionType.ENCODER_ONLY
        self.self_attn = attn_layer_type(
            config=config, hidden_size=self.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            max_position_embeddings=max_position_embeddings, quant_config=quant_config,
            bias=attention_bias, bias_o_proj=bias_o_proj, cache_config=cache_config,
            prefix=f"{prefix}.self_attn", attn_type=attn_type)
        self.mlp = LlamaMLP(hidden_size=self.hidden_size, intermediate_size=config.intermediate_size,
                            hidden_act=config.hidden_act, quant_config=quant_config,
                            bias=getattr(config, "mlp_bias", False), prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual

    def get_quant_config(self, vllm_config: VllmConfig) -> QuantizationConfig | None:
        """Subclasses override this to give their layers another quantization config."""
        return vllm_config.quant_config


def llama_model_invariants(*args, **kwargs) -> None:
    """Kept for import compatibility with older model files; 0.33 has no shape invariants."""


@support_torch_compile(dynamic_arg_dims={"input_ids": {0: "b"}, "positions": {0: "b"},
                                         "intermediate_tensors": {0: "b"},
                                         "inputs_embeds": {0: "b"}})
class LlamaModel(nn.Module, EagleModelMixin):
    supports_aux_hidden_states_over_pp = True
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={
        ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = LlamaDecoderLayer) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.vocab_size = config.vocab_size
        pp_group = get_pp_group()
        if (pp_group.is_first_rank or (config.tie_word_embeddings and pp_group.is_last_rank)
                or spec_decode_needs_target_embed(vllm_config)):
            self.embed_tokens = VocabParallelEmbedding(self.vocab_size, config.hidden_size,
                                                       quant_config=self.quant_config,
                                                       prefix=maybe_prefix(prefix, "embed_tokens"))
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: layer_type(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if pp_group.is_last_rank \
            else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None,
                inputs_embeds: torch.Tensor | None = None, **extra_layer_kwargs
                ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None \
                else self.embed_input_ids(input_ids)       # [T, H]
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)
        aux_hidden_states: list[torch.Tensor] = []
        if get_pp_group().is_first_rank:
            self._maybe_add_hidden_state(aux_hidden_states, self.start_layer, hidden_states, residual)
        for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer),
                                    start=self.start_layer):
            hidden_states, residual = layer(positions, hidden_states, residual, **extra_layer_kwargs)
            self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual,
                                        **self.pack_local_aux_hidden_states(aux_hidden_states)})
        hidden_states, _ = self.norm(hidden_states, residual)
        aux_hidden_states = remote_aux + aux_hidden_states
        if len(aux_hidden_states) > 0:
            return hidden_states, aux_hidden_states
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


class LlamaForCausalLM(LocalArgmaxMixin, nn.Module, SupportsLoRA, SupportsPP, SupportsEagle,
                       SupportsEagle3, SupportsQuant):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
    hf_to_vllm_mapper = LlamaModel.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = LlamaDecoderLayer) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.config = config
        self.model = self._init_model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                      layer_type=layer_type)
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          quant_config=quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            logit_scale = getattr(config, "logit_scale", 1.0)
            self.logits_processor = LogitsProcessor(config.vocab_size, scale=logit_scale)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = LlamaDecoderLayer) -> nn.Module:
        return LlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def compute_logits_local(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states, skip_gather=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights)


# Pooling variants are built at import time, as in vLLM.
if TYPE_CHECKING:
    LlamaEmbeddingModel = LlamaForCausalLM
else:
    LlamaEmbeddingModel = as_embedding_model(LlamaForCausalLM)
LlamaForSequenceClassification = as_seq_cls_model(LlamaForCausalLM)


def _bidirectional(base: type[nn.Module]) -> type[nn.Module]:
    """A pooling Llama whose attention sees the whole sequence (LlamaBidirectionalConfig)."""

    class Bidirectional(base):
        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs) -> None:
            # NOTE: vLLM's LlamaBidirectionalConfig forces is_causal=False the same way.
            vllm_config.model_config.hf_config.is_causal = False
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)

    return Bidirectional


LlamaBidirectionalModel = _bidirectional(LlamaEmbeddingModel)
LlamaBidirectionalModel.__name__ = LlamaBidirectionalModel.__qualname__ = "LlamaBidirectionalModel"
LlamaBidirectionalForSequenceClassification = _bidirectional(LlamaForSequenceClassification)
LlamaBidirectionalForSequenceClassification.__name__ = "LlamaBidirectionalForSequenceClassification"
LlamaBidirectionalForSequenceClassification.__qualname__ = "LlamaBidirectionalForSequenceClassification"
