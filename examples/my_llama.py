"""An out-of-tree model file: Llama, written from scratch against vLLM's model-file contract.

The file imports only vLLM paths (`minivllm.` here, `vllm.` in vLLM) and lives outside the
package. Check it against a checkpoint, layer by layer against transformers:

    minivllm check-model CKPT --model-file examples/my_llama.py:MyLlamaForCausalLM --hf

and run it by registering it (in the driver, or in a plugin for every process; see README,
"Writing a model file"):

    ModelRegistry.register_model("MyLlamaForCausalLM", "my_pkg.my_llama:MyLlamaForCausalLM")

Tensor parallelism comes from the layers; pipeline parallelism from `make_layers` (this stage's
layers, placeholders for the others) and the IntermediateTensors handed between stages.
"""

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.config import CacheConfig, VllmConfig
from minivllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from minivllm.model_executor.layers.activation import SiluAndMul
from minivllm.model_executor.layers.attention import Attention
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope
from minivllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding)
from minivllm.model_executor.models.interfaces import SupportsPP, SupportsQuant
from minivllm.model_executor.models.utils import (AutoWeightsLoader, PPMissingLayer, WeightsMapper,
                                                  make_empty_intermediate_tensors_factory,
                                                  make_layers, maybe_prefix)
from minivllm.sequence import IntermediateTensors


class MyMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        # NOTE: every layer gets its attribute path as prefix: quantization and LoRA match it.
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.gate_up_proj(x)            # [T, 2 * I / TP]
        x, _ = self.down_proj(self.act_fn(x))  # [T, H], all-reduced over TP
        return x


class MyAttention(nn.Module):
    def __init__(self, config, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", total_heads)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.num_heads = total_heads // tp_size
        self.num_kv_heads = max(1, total_kv_heads // tp_size)   # replicated when KV < TP
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads,
                                          total_kv_heads, bias=False, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        bias=False, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None),
                                   is_neox_style=True)
        # The attention layer's prefix is its key in the forward context and the KV cache.
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5,
                              num_kv_heads=self.num_kv_heads, cache_config=cache_config,
                              quant_config=quant_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)            # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))         # [T, H]
        return out


class MyDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.self_attn = MyAttention(config, vllm_config.cache_config, quant_config,
                                     prefix=f"{prefix}.self_attn")
        self.mlp = MyMLP(config.hidden_size, config.intermediate_size, quant_config,
                         prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream stays outside the norms: norm(x, residual) adds, then normalises.
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class MyModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        pp = get_pp_group()
        # The first stage embeds; the last normalises (and, tied, also needs the embedding).
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "embed_tokens")
        ) if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank) \
            else PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda prefix: MyDecoderLayer(vllm_config, prefix),
            prefix=f"{prefix}.layers")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if pp.is_last_rank \
            else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None \
                else self.embed_tokens(input_ids)         # [T, H]
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class MyLlamaForCausalLM(nn.Module, SupportsPP, SupportsQuant):
    # The checkpoint's q/k/v and gate/up tensors are shards of the fused layers: the mapping
    # tells quantization and LoRA the shard names, the mapper routes the tensors while loading.
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={
        ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.model = MyModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        if not get_pp_group().is_last_rank:
            self.lm_head = PPMissingLayer()     # the loader drops this stage's lm_head weights
            return
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)   # [S, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)
