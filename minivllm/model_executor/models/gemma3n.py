"""Gemma 3n (text, transformers' `Gemma3nTextConfig`; the released checkpoints'
`Gemma3nForConditionalGeneration` served text-only).

Gemma 4's attention (q / k / v norms, scale 1, sliding / full layers, KV-sharing last layers
reading the last earlier layer of their type) and per-layer input embeddings, inside a different
block: the residual stream is `altup_num_inputs` parallel streams `[S, T, H]` (AltUp). Each
layer predicts all streams from a learned mix, runs attention + a Laurel low-rank branch + the
MLP on the active stream only, then corrects every stream with the innovation and feeds the
per-layer input into the others. MLP widths may differ per layer, and some layers' gates are
sparsified by a gaussian top-k (`activation_sparsity_pattern`). The streams are projected from
the embeddings at the start and averaged back (after un-projection) at the end.
"""

from collections.abc import Iterable
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import VllmConfig
from minivllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from minivllm.distributed.communication_op import tensor_model_parallel_all_reduce
from minivllm.model_executor.layers.activation import GeluAndMulSparse
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import ReplicatedLinear
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from minivllm.sequence import IntermediateTensors

from .gemma import GemmaMLP, gemma_activation
from .gemma4 import Gemma4Attention, Gemma4Model
from .interfaces import SupportsPP, SupportsQuant
from .text_only import TextOnlyConditionalGeneration, text_of_vl_mapper
from .utils import AutoWeightsLoader, PPMissingLayer, extract_layer_index, maybe_prefix

# The multimodal checkpoints' towers and their embedders: skipped.
_TOWERS = ("model.audio_tower.", "model.vision_tower.", "model.embed_audio.",
           "model.embed_vision.")


class _TPGeluAndMulSparse(GeluAndMulSparse):
    """The sparse gate when the MLP is split over TP: each rank holds `I / TP` gate columns, but
    the cutoff's mean and std are over all `I`, so their sums are all-reduced first."""

    def __init__(self, activation_sparsity: float, approximate: str, width: int) -> None:
        super().__init__(activation_sparsity, approximate)
        self.width = width                                 # I, the whole gate

    def _sparsify(self, gate: torch.Tensor) -> torch.Tensor:
        # gate [T, I / TP] -> sums [T, 2] over every rank's columns, in fp32: a bf16 sum of
        # thousands of squares would lose the variance.
        wide = gate.float()
        sums = torch.stack([wide.sum(-1), wide.square().sum(-1)], dim=-1)
        mean, mean_sq = (tensor_model_parallel_all_reduce(sums) / self.width).unbind(-1)
        std = (mean_sq - mean.square()).clamp_min(0).sqrt()
        cutoff = (mean + std * self.std_multiplier).unsqueeze(-1).to(gate.dtype)  # [T, 1]
        return F.relu(gate - cutoff)


def gemma3n_mlp(config: Any, layer_idx: int, quant_config: QuantizationConfig | None,
                prefix: str) -> GemmaMLP:
    """Gemma's gated MLP at this layer's width, its gate sparsified where the pattern says."""
    width = config.intermediate_size
    width = width[layer_idx] if isinstance(width, (list, tuple)) else width
    approximate = gemma_activation(config)
    mlp = GemmaMLP(config.hidden_size, width, approximate, quant_config=quant_config,
                   prefix=prefix)
    pattern = getattr(config, "activation_sparsity_pattern", None) or ()
    sparsity = pattern[layer_idx] if layer_idx < len(pattern) else 0.0
    if sparsity > 0.0:
        mlp.act_fn = GeluAndMulSparse(sparsity, approximate) \
            if get_tensor_model_parallel_world_size() == 1 \
            else _TPGeluAndMulSparse(sparsity, approximate, width)
    return mlp


class Gemma3nAltUp(nn.Module):
    """Alternating updates over S streams `[S, T, H]`: a router on one stream sets, per token,
    an S x S mix to predict every stream and S gains to spread the active stream's update."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str = "") -> None:
        super().__init__()
        hidden, self.num_inputs = config.hidden_size, config.altup_num_inputs
        self.active_idx = config.altup_active_idx
        # NOTE: altup_coef_clip only clamps the coefficients while training.
        for name, out in (("correction_coefs", self.num_inputs),
                          ("prediction_coefs", self.num_inputs**2)):
            setattr(self, name, ReplicatedLinear(self.num_inputs, out, bias=False,
                                                 quant_config=quant_config,
                                                 prefix=f"{prefix}.{name}"))
        self.modality_router = ReplicatedLinear(hidden, self.num_inputs, bias=False,
                                                quant_config=quant_config,
                                                prefix=f"{prefix}.modality_router")
        self.router_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.router_input_scale = 1.0 / hidden
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden), requires_grad=False)

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed, _ = self.modality_router(self.router_norm(x) * self.router_input_scale)
        return torch.tanh(routed.float()).type_as(x)      # [T, S]

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """[S, T, H] -> [S, T, H]: stream i + sum_j coef[t, i, j] * stream j."""
        coefs, _ = self.prediction_coefs(self._modalities(streams[self.active_idx]))
        coefs = coefs.unflatten(-1, (self.num_inputs, self.num_inputs))    # [T, S_out, S_in]
        mixed = torch.einsum("tij,jth->ith", coefs, streams)
        return (streams + mixed).contiguous()

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Every stream plus `(1 + gain[t, i])` times the active stream's innovation [T, H]."""
        gains, _ = self.correction_coefs(self._modalities(activated))      # [T, S]
        innovation = activated - predictions[self.active_idx]              # [T, H]
        return predictions + (gains + 1.0).T[:, :, None] * innovation[None]

    def scale_corrected_output(self, x: torch.Tensor) -> torch.Tensor:
        return (x.type_as(self.correct_output_scale) * self.correct_output_scale).type_as(x)


class Gemma3nLaurelBlock(nn.Module):
    """Learned augmented residual: x + norm(right(left(x))), rank `laurel_rank` (replicated)."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str = "") -> None:
        super().__init__()
        hidden, rank = config.hidden_size, config.laurel_rank
        self.linear_left = ReplicatedLinear(hidden, rank, bias=False, quant_config=quant_config,
                                            prefix=f"{prefix}.linear_left")
        self.linear_right = ReplicatedLinear(rank, hidden, bias=False, quant_config=quant_config,
                                             prefix=f"{prefix}.linear_right")
        self.post_laurel_norm = RMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low, _ = self.linear_left(x)                       # [T, rank]
        back, _ = self.linear_right(low)                   # [T, H]
        return x + self.post_laurel_norm(back)


class Gemma3nDecoderLayer(nn.Module):
    """AltUp predict -> on the active stream: (x + norm(attn) + laurel) / sqrt(2), then
    + norm(MLP) -> AltUp correct -> the per-layer input, gated by the scaled active stream,
    added to the other streams. Streams `[S, T, H]` in and out."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        layer_idx = extract_layer_index(prefix)
        self.active_idx, self.correct_scale = config.altup_active_idx, config.altup_correct_scale
        self.approximate = gemma_activation(config)
        self.altup = Gemma3nAltUp(config, quant_config, prefix=f"{prefix}.altup")
        self.self_attn = Gemma4Attention(vllm_config, config, prefix=f"{prefix}.self_attn")
        self.mlp = gemma3n_mlp(config, layer_idx, quant_config, prefix=f"{prefix}.mlp")
        self.laurel = Gemma3nLaurelBlock(config, quant_config, prefix=f"{prefix}.laurel")
        size = config.hidden_size_per_layer_input
        # Small [H -> P -> H]: replicated, as the per-layer input they mix with.
        self.per_layer_input_gate = ReplicatedLinear(hidden, size, bias=False,
                                                     quant_config=quant_config,
                                                     prefix=f"{prefix}.per_layer_input_gate")
        self.per_layer_projection = ReplicatedLinear(size, hidden, bias=False,
                                                     quant_config=quant_config,
                                                     prefix=f"{prefix}.per_layer_projection")
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_per_layer_input_norm"):
            setattr(self, name, RMSNorm(hidden, eps=eps))

    def forward(self, positions: torch.Tensor, streams: torch.Tensor,
                per_layer_input: torch.Tensor) -> torch.Tensor:
        predictions = self.altup.predict(streams)          # [S, T, H]
        active = predictions[self.active_idx]              # [T, H]
        normed = self.input_layernorm(active)
        attn = self.post_attention_layernorm(self.self_attn(positions, normed))
        x = (active + attn + self.laurel(normed)) * 2.0**-0.5
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)     # [S, T, H]
        first = corrected[self.active_idx]
        if self.correct_scale:
            first = self.altup.scale_corrected_output(first)
        gate, _ = self.per_layer_input_gate(first)         # [T, P]
        gated = F.gelu(gate, approximate=self.approximate) * per_layer_input
        extra, _ = self.per_layer_projection(gated)        # [T, H]
        # NOTE: as the reference, every stream but the first (not "but the active one").
        extra = self.post_per_layer_input_norm(extra)
        return torch.cat([corrected[:1], corrected[1:] + extra], dim=0)


@support_torch_compile
class Gemma3nModel(Gemma4Model):
    """Gemma 4's embeddings, per-layer inputs and layer list, with S AltUp streams between
    the layers: `[S, T, H]` within a stage, `[T, S, H]` between PP stages."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Gemma3nDecoderLayer) -> None:
        config = vllm_config.model_config.hf_config
        if not getattr(config, "hidden_size_per_layer_input", 0):
            raise ValueError("Gemma 3n needs hidden_size_per_layer_input > 0 (its layers all "
                             "take a per-layer input)")
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        self.num_streams = config.altup_num_inputs
        pp_group = get_pp_group()
        for name, present in (("altup_projections", pp_group.is_first_rank),
                              ("altup_unembed_projections", pp_group.is_last_rank)):
            setattr(self, name, nn.ModuleList(
                ReplicatedLinear(config.hidden_size, config.hidden_size, bias=False,
                                 quant_config=vllm_config.quant_config,
                                 prefix=f"{prefix}.{name}.{i}")
                for i in range(self.num_streams - 1)) if present else PPMissingLayer())

    def get_per_layer_inputs(self, input_ids: torch.Tensor | None,
                             inputs_embeds: torch.Tensor) -> torch.Tensor:
        # The per-layer vocabulary is shorter than the model's: other ids read row 0.
        if input_ids is not None:
            in_table = (input_ids >= 0) & (input_ids < self.config.vocab_size_per_layer_input)
            input_ids = torch.where(in_table, input_ids, torch.zeros_like(input_ids))
        return super().get_per_layer_inputs(input_ids, inputs_embeds)

    @staticmethod
    def _rescaled(x: torch.Tensor, target_rms: torch.Tensor) -> torch.Tensor:
        # [T, H] to the target's RMS per token (the reference floors the mean square at 1e-5)
        return x * target_rms / x.square().mean(-1, keepdim=True).clamp_min(1e-5).sqrt()

    def _project_streams(self, projections: nn.ModuleList, streams: list[torch.Tensor]
                         ) -> torch.Tensor:
        """[S, T, H]: stream 0 as is, stream i projected and rescaled to stream 0's RMS."""
        target = streams[0].square().mean(-1, keepdim=True).sqrt()         # [T, 1]
        out = [streams[0]]
        for proj, stream in zip(projections, streams[1:]):
            projected, _ = proj(stream)
            out.append(self._rescaled(projected, target))
        return torch.stack(out)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None,
                inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            embeds = inputs_embeds if inputs_embeds is not None \
                else self.embed_input_ids(input_ids)                       # [T, H]
            per_layer_inputs = self.get_per_layer_inputs(input_ids, embeds)    # [T, L, P]
            streams = self._project_streams(self.altup_projections,
                                            [embeds] * self.num_streams)   # [S, T, H]
        else:
            assert intermediate_tensors is not None
            streams = intermediate_tensors["hidden_states"].transpose(0, 1)
            per_layer_inputs = intermediate_tensors["per_layer_inputs"]
        for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer),
                                    start=self.start_layer):
            streams = layer(positions, streams, per_layer_inputs[:, idx])
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": streams.transpose(0, 1).contiguous(),
                                        "per_layer_inputs": per_layer_inputs})
        streams = self._project_streams(self.altup_unembed_projections, list(streams))
        return self.norm(streams.mean(0))                                  # [T, H]

    def _make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype,
                                         device: torch.device) -> IntermediateTensors:
        """PP receive buffers: streams [B, S, H] and per-layer inputs [B, L, P]."""
        config = self.config
        return IntermediateTensors({
            "hidden_states": torch.zeros(batch_size, self.num_streams, config.hidden_size,
                                         dtype=dtype, device=device),
            "per_layer_inputs": torch.zeros(batch_size, config.num_hidden_layers,
                                            self.per_layer_size, dtype=dtype, device=device)})


class Gemma3nForCausalLM(nn.Module, SupportsPP, SupportsQuant):
    """The text model with its (tied) LM head and final logit soft cap."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = Gemma3nModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(
                config.vocab_size, soft_cap=getattr(config, "final_logit_softcapping", None))
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights)


class Gemma3nForConditionalGeneration(TextOnlyConditionalGeneration, Gemma3nForCausalLM):
    """The released (multimodal) checkpoints, TEXT ONLY (see `text_only`):
    `model.language_model.*` loads as `model.*`; the vision and audio towers and their
    embedders are skipped."""

    skipped_prefixes = _TOWERS
    hf_to_vllm_mapper = text_of_vl_mapper({"model.language_model.": "model."}, _TOWERS)


__all__ = ["Gemma3nAltUp", "Gemma3nDecoderLayer", "Gemma3nForCausalLM",
           "Gemma3nForConditionalGeneration", "Gemma3nLaurelBlock", "Gemma3nModel",
           "gemma3n_mlp"]
