"""Gemma 4 (text, transformers' `Gemma4TextConfig`): Gemma 3's interleaved sliding / full layers
with sandwich norms, but plain `x * w` RMSNorms, attention scale 1 (QK-norm bounds the logits)
and a weightless value norm. Full layers have their own head size and KV heads (`per_layer_config`),
may take V = K (`attention_k_eq_v`) and use proportional partial RoPE. Optional extras, each as
transformers runs it: per-layer input embeddings (E2B / E4B's `hidden_size_per_layer_input`),
last layers that read an earlier layer's KV cache (`num_kv_shared_layers`), a MoE block beside
the MLP (`enable_moe_block`), double-wide MLPs on the KV-sharing layers, a learned per-layer
output scale (`layer_scalar`) and soft-capped final logits."""

from collections.abc import Iterable
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import VllmConfig
from minivllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from minivllm.model_executor.layers.attention import Attention
from minivllm.model_executor.layers.fused_moe import FusedMoE, fused_topk
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                                   ReplicatedLinear, RowParallelLinear)
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope
from minivllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from minivllm.sequence import IntermediateTensors

from .gemma import GemmaMLP, GemmaModel, gemma_activation
from .gemma2 import gemma_layer_type
from .gemma3 import Gemma3ForCausalLM, gemma3_rope_parameters
from .interfaces import MixtureOfExperts
from .utils import (AutoWeightsLoader, PPMissingLayer, ShardIds, WeightsMapper,
                    extract_layer_index, maybe_prefix)


def first_kv_shared_layer(config: Any) -> int:
    """Index of the first layer that reads another layer's cache (num_hidden_layers: none)."""
    return config.num_hidden_layers - (getattr(config, "num_kv_shared_layers", 0) or 0)


def kv_sharing_target(config: Any, layer_idx: int) -> int | None:
    """The layer whose cache `layer_idx` reads: the last non-sharing layer of its type."""
    first_shared = first_kv_shared_layer(config)
    if layer_idx < first_shared:
        return None
    layer_type = gemma_layer_type(config, layer_idx)
    owners = [i for i in range(first_shared) if gemma_layer_type(config, i) == layer_type]
    if not owners:
        raise ValueError(f"KV-sharing layer {layer_idx} ({layer_type}) has no earlier "
                         f"{layer_type} layer to read from; lower num_kv_shared_layers")
    return owners[-1]


def _k_eq_v(config: Any, layer_idx: int) -> bool:
    """Full layers of `attention_k_eq_v` models ship k_proj only: V is K (normed differently)."""
    return (bool(getattr(config, "attention_k_eq_v", False))
            and gemma_layer_type(config, layer_idx) == "full_attention")


def _check_tp_split(layer_idx: int, num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Heads split evenly; KV heads split, or are replicated when there are fewer than TP."""
    def splits(t: int) -> bool:
        return num_heads % t == 0 and (num_kv_heads % t == 0 if num_kv_heads >= t
                                       else t % num_kv_heads == 0)
    if not splits(tp_size):
        valid = [t for t in range(1, num_heads + 1) if splits(t)]
        raise ValueError(f"layer {layer_idx}: {num_heads} heads and {num_kv_heads} KV heads "
                         f"cannot be split over tensor parallel size {tp_size}; valid: {valid}")


class Gemma4Attention(nn.Module):
    """[QKV | Q] -> per-head q/k/v norms -> RoPE on q, k -> attention (scale 1) -> o_proj.

    q `[T, nH*d]`, k/v `[T, nKV*d]` for this TP rank's heads, d this layer's head size. A
    KV-sharing layer projects only q and attends over its target layer's cache."""

    def __init__(self, vllm_config: VllmConfig, config: Any, prefix: str = "") -> None:
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        # transformers keeps the full layers' sizes in `per_layer_config` (the global fields
        # raise on a heterogeneous config); configs without it (Gemma 3n) are uniform.
        per_layer = getattr(config, "per_layer_config", None)
        layer_config = config if per_layer is None else per_layer[layer_idx]
        head_dim, num_kv_heads = layer_config.head_dim, layer_config.num_key_value_heads
        tp_size = get_tensor_model_parallel_world_size()
        num_heads = config.num_attention_heads
        _check_tp_split(layer_idx, num_heads, num_kv_heads, tp_size)
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)    # replicated below TP heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        quant_config, eps = vllm_config.quant_config, config.rms_norm_eps
        bias = getattr(config, "attention_bias", False)
        target = kv_sharing_target(config, layer_idx)
        self.is_kv_shared_layer = target is not None
        if self.is_kv_shared_layer:
            self.q_proj = ColumnParallelLinear(config.hidden_size, num_heads * head_dim,
                                               bias=bias, quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
        else:
            self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads,
                                              num_kv_heads, bias=bias, quant_config=quant_config,
                                              prefix=f"{prefix}.qkv_proj")
            self.k_norm = RMSNorm(head_dim, eps=eps)
            self.v_norm = RMSNorm(head_dim, eps=eps, has_weight=False)
        self.q_norm = RMSNorm(head_dim, eps=eps)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        layer_type = gemma_layer_type(config, layer_idx)
        self.rotary_emb = get_rope(head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=gemma3_rope_parameters(config, layer_type),
                                   is_neox_style=True)
        # The target's attention, named as this layer's: "model.layers.{target}.self_attn.attn".
        shared_name = None if target is None else \
            f"{prefix.rsplit(f'layers.{layer_idx}.', 1)[0]}layers.{target}.self_attn.attn"
        window = config.sliding_window if layer_type == "sliding_attention" else None
        # NOTE: scale 1: the q / k norms are trained to set the logits' scale.
        self.attn = Attention(self.num_heads, head_dim, 1.0, num_kv_heads=self.num_kv_heads,
                              cache_config=vllm_config.cache_config, quant_config=quant_config,
                              per_layer_sliding_window=window,
                              kv_sharing_target_layer_name=shared_name, prefix=f"{prefix}.attn")

    def _per_head(self, norm: nn.Module, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        # [T, heads * d] -> [T, heads, d] for the norm -> back
        return norm(x.unflatten(-1, (num_heads, self.head_dim))).flatten(-2)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.is_kv_shared_layer:                        # k / v come from the target's cache
            q, _ = self.q_proj(hidden_states)              # [T, q_size]
            q, _ = self.rotary_emb(positions, self._per_head(self.q_norm, q, self.num_heads),
                                   None)
            k = v = None
        else:
            qkv, _ = self.qkv_proj(hidden_states)          # [T, q_size + 2 * kv_size]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self._per_head(self.q_norm, q, self.num_heads)
            k = self._per_head(self.k_norm, k, self.num_kv_heads)
            v = self._per_head(self.v_norm, v, self.num_kv_heads)
            q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))        # [T, q_size] -> [T, H]
        return output


class Gemma4Router(nn.Module):
    """Router logits [T, E] from the un-normed residual stream: weightless RMSNorm, times
    `scale * H^-0.5`, projected (replicated over TP so every rank routes alike)."""

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, has_weight=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts), requires_grad=False)
        self.root_size = config.hidden_size**-0.5
        self.proj = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False,
                                     quant_config=None, prefix=f"{prefix}.proj")

    def routing_function(self, hidden_states: torch.Tensor, gating_output: torch.Tensor,
                         topk: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over all experts -> top-k -> renormalised -> times each chosen expert's
        `per_expert_scale`: (weights [T, k] fp32, ids [T, k])."""
        weights, ids, _ = fused_topk(hidden_states, gating_output, topk, renormalize)
        return weights * self.per_expert_scale[ids].float(), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x) * self.root_size * self.scale
        logits, _ = self.proj(x)
        return logits


class Gemma4DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(norm(x))); then x + post_ff_norm(MLP [+ MoE]); then the
    per-layer input branch; the whole stream times `layer_scalar`. Stream [T, H] in and out."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(vllm_config, config, prefix=f"{prefix}.self_attn")
        wide = getattr(config, "use_double_wide_mlp", False) and self.self_attn.is_kv_shared_layer
        approximate = gemma_activation(config)
        self.mlp = GemmaMLP(hidden, config.intermediate_size * (2 if wide else 1), approximate,
                            quant_config=quant_config, prefix=f"{prefix}.mlp")
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(hidden, eps=eps))
        self.enable_moe_block = bool(getattr(config, "enable_moe_block", False))
        if self.enable_moe_block:
            self._init_moe(config, quant_config, approximate, prefix)
        self.per_layer_size = getattr(config, "hidden_size_per_layer_input", 0) or 0
        if self.per_layer_size:
            self._init_per_layer_input(config, quant_config, approximate, prefix)
        # Loaded from the checkpoint (transformers saves the buffer); [1].
        self.register_buffer("layer_scalar", torch.ones(1))

    def _init_moe(self, config: Any, quant_config: QuantizationConfig | None, approximate: str,
                  prefix: str) -> None:
        """Router and experts beside the MLP, with their own pre / post norms."""
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.router = Gemma4Router(config, prefix=f"{prefix}.router")
        # reduce_results: summed over TP like the MLP's output, before the two are normed.
        self.experts = FusedMoE(
            num_experts=config.num_experts, top_k=config.top_k_experts, hidden_size=hidden,
            intermediate_size=config.moe_intermediate_size, reduce_results=True,
            renormalize=True, quant_config=quant_config, prefix=f"{prefix}.experts",
            custom_routing_function=self.router.routing_function,
            activation="gelu_tanh" if approximate == "tanh" else "gelu")
        for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            setattr(self, name, RMSNorm(hidden, eps=eps))

    def _init_per_layer_input(self, config: Any, quant_config: QuantizationConfig | None,
                              approximate: str, prefix: str) -> None:
        """Gate [H -> P] and projection [P -> H] (small: replicated over TP) and their norm."""
        hidden, size = config.hidden_size, self.per_layer_size
        self.approximate = approximate
        self.per_layer_input_gate = ReplicatedLinear(hidden, size, bias=False,
                                                     quant_config=quant_config,
                                                     prefix=f"{prefix}.per_layer_input_gate")
        self.per_layer_projection = ReplicatedLinear(size, hidden, bias=False,
                                                     quant_config=quant_config,
                                                     prefix=f"{prefix}.per_layer_projection")
        self.post_per_layer_input_norm = RMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                per_layer_input: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden_states                                  # [T, H], the residual stream
        attn = self.self_attn(positions, self.input_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.enable_moe_block:                          # experts and router see x, not h
            moe = self.experts(self.pre_feedforward_layernorm_2(x), self.router(x))
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_size:                            # per_layer_input [T, P]
            gate, _ = self.per_layer_input_gate(x)         # [T, P]
            gated = F.gelu(gate, approximate=self.approximate) * per_layer_input
            extra, _ = self.per_layer_projection(gated)    # [T, H]
            x = x + self.post_per_layer_input_norm(extra)
        return x * self.layer_scalar


@support_torch_compile
class Gemma4Model(GemmaModel):
    """Gemma's scaled embeddings and layer loop; per-layer inputs [T, L, P] are built once on
    the first PP rank and travel with the hidden states; no residual stream between layers."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Gemma4DecoderLayer) -> None:
        config = vllm_config.model_config.hf_config
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise NotImplementedError("use_bidirectional_attention='all' is not supported; "
                                      "only causal Gemma 4 (None or 'vision')")
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        if get_pp_group().is_last_rank:                    # x * w, not Gemma's (1 + w)
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.per_layer_size = getattr(config, "hidden_size_per_layer_input", 0) or 0
        if self.per_layer_size:
            self._init_per_layer_inputs(config, vllm_config, prefix)
        self.hf_to_vllm_mapper = gemma4_weights_mapper(config)
        self.make_empty_intermediate_tensors = self._make_empty_intermediate_tensors

    def _init_per_layer_inputs(self, config: Any, vllm_config: VllmConfig, prefix: str) -> None:
        width = config.num_hidden_layers * self.per_layer_size     # L * P, all layers packed
        if not get_pp_group().is_first_rank:
            for name in ("embed_tokens_per_layer", "per_layer_model_projection",
                         "per_layer_projection_norm"):
                setattr(self, name, PPMissingLayer())    # one each: a shared one has one name
            return
        self.embed_tokens_per_layer = VocabParallelEmbedding(
            config.vocab_size_per_layer_input, width, quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "embed_tokens_per_layer"))
        self.per_layer_model_projection = ReplicatedLinear(
            config.hidden_size, width, bias=False, quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "per_layer_model_projection"))
        self.per_layer_projection_norm = RMSNorm(self.per_layer_size, eps=config.rms_norm_eps)
        # transformers rounds sqrt(P) to the activation dtype, as Gemma's embedding scale.
        self.register_buffer("embed_scale_per_layer", torch.tensor(self.per_layer_size**0.5),
                             persistent=False)

    def get_per_layer_inputs(self, input_ids: torch.Tensor | None,
                             inputs_embeds: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: (RMSNorm(proj(embeds) / sqrt(H)) + embed_per_layer(ids)) / sqrt(2). Without
        ids (embeddings given) only the projection part, as vLLM does."""
        proj, _ = self.per_layer_model_projection(inputs_embeds)          # [T, L * P]
        proj = proj * self.config.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.unflatten(-1, (-1, self.per_layer_size)))
        if input_ids is None:
            return proj
        token_part = self.embed_tokens_per_layer(input_ids)                # [T, L * P]
        token_part = token_part * self.embed_scale_per_layer.to(token_part.dtype)
        return (proj + token_part.unflatten(-1, (-1, self.per_layer_size))) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None,
                inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        per_layer_inputs = None                                            # [T, L, P]
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None \
                else self.embed_input_ids(input_ids)                       # [T, H]
            if self.per_layer_size:
                per_layer_inputs = self.get_per_layer_inputs(input_ids, hidden_states)
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            if self.per_layer_size:
                per_layer_inputs = intermediate_tensors["per_layer_inputs"]
        aux = self.collect_remote_aux_hidden_states(intermediate_tensors)
        local_aux: list[torch.Tensor] = []       # aux k: the input of layer k (0: embeddings)
        if get_pp_group().is_first_rank:
            self._maybe_add_hidden_state(local_aux, self.start_layer, hidden_states, None)
        for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer),
                                    start=self.start_layer):
            layer_input = None if per_layer_inputs is None else per_layer_inputs[:, idx]
            hidden_states = layer(positions, hidden_states, layer_input)
            self._maybe_add_hidden_state(local_aux, idx + 1, hidden_states, None)
        if not get_pp_group().is_last_rank:
            tensors = {"hidden_states": hidden_states,
                       **self.pack_local_aux_hidden_states(local_aux)}
            if per_layer_inputs is not None:
                tensors["per_layer_inputs"] = per_layer_inputs
            return IntermediateTensors(tensors)
        hidden_states = self.norm(hidden_states)
        aux = aux + local_aux
        return (hidden_states, aux) if aux else hidden_states

    def _make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype,
                                         device: torch.device) -> IntermediateTensors:
        """PP receive buffers: hidden [B, H] and, with per-layer inputs, [B, L, P]."""
        tensors = {"hidden_states": torch.zeros(batch_size, self.config.hidden_size,
                                                dtype=dtype, device=device)}
        if self.per_layer_size:
            tensors["per_layer_inputs"] = torch.zeros(
                batch_size, self.config.num_hidden_layers, self.per_layer_size, dtype=dtype,
                device=device)
        return IntermediateTensors(tensors)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


def gemma4_weights_mapper(config: Any) -> WeightsMapper:
    """q/k/v -> qkv_proj and gate/up -> gate_up_proj per layer: k_proj fills K and V on V = K
    layers; the k/v tensors that original checkpoints still ship for KV-sharing layers (which
    only project q) are dropped."""
    first_shared = first_kv_shared_layer(config)
    stacked: dict[str, tuple[str, ShardIds]] = {".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
                                                ".mlp.up_proj.": (".mlp.gate_up_proj.", 1)}
    for i in range(first_shared):
        k_ids: ShardIds = ["k", "v"] if _k_eq_v(config, i) else "k"
        for shard, ids in (("q", "q"), ("k", k_ids), ("v", "v")):
            stacked[f"layers.{i}.self_attn.{shard}_proj."] = (f"layers.{i}.self_attn.qkv_proj.",
                                                               ids)
    dropped = {f"layers.{i}.self_attn.{name}.": None
               for i in range(first_shared, config.num_hidden_layers)
               for name in ("k_proj", "v_proj", "k_norm", "v_norm")}
    return WeightsMapper(orig_to_new_substr=dropped, orig_to_new_stacked=stacked)


class Gemma4ForCausalLM(Gemma3ForCausalLM, MixtureOfExperts):
    """Gemma 4's text model with Gemma's (tied) LM head and its final logit soft cap; LoRA, PP,
    quantization and EAGLE-3 as Llama. MoE counts for the MixtureOfExperts interface."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}
    # Weights saved from the multimodal model: its text stack, without the towers.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_substr={"audio_tower.": None, "vision_tower.": None, "embed_audio.": None,
                            "embed_vision.": None},
        orig_to_new_prefix={"model.language_model.": "model."})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Gemma4DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        self.moe_layers = [layer.experts for layer in self.model.layers
                           if not isinstance(layer, PPMissingLayer) and layer.enable_moe_block]
        self.expert_weights = []
        self.num_moe_layers = len(self.moe_layers)
        num_experts = self.config.num_experts if self.num_moe_layers else 0
        self.num_logical_experts = self.num_physical_experts = num_experts
        self.num_local_physical_experts = self.num_routed_experts = num_experts
        self.num_expert_groups, self.num_shared_experts, self.num_redundant_experts = 1, 0, 0

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = Gemma4DecoderLayer) -> nn.Module:
        return Gemma4Model(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


__all__ = ["Gemma4Attention", "Gemma4DecoderLayer", "Gemma4ForCausalLM", "Gemma4Model",
           "Gemma4Router", "gemma4_weights_mapper", "kv_sharing_target"]
