"""EAGLE-3 heads for Llama-family targets (vLLM's `Eagle3LlamaForCausalLM`, the `eagle3`
method; checkpoints name it `LlamaForCausalLMEagle3`).

EAGLE-3 reads several of the target's layers, not only its last: the target returns the
residual streams entering a few layers (`aux_hidden_state_layers`, by default 2, L // 2 and
L - 3), concatenated [T, n * H_target]; `combine_hidden_states` (fc) maps them to the head's
width H. The head's first layer attends over [input_layernorm(embed(t_{j+1})),
hidden_norm(g_j)] [2H] (its q/k/v projections take 2H), keeping g_j as the residual; later
layers are plain blocks. A final norm gives the features the head's own LM head reads; the
pre-norm sum is what the next draft step reads as g. The LM head may cover a smaller draft
vocabulary: `d2t` maps draft id i to target id i + d2t[i], the other target ids get -inf.
"""

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import VllmConfig, get_current_vllm_config
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import QKVParallelLinear
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding)
from minivllm.model_executor.models.llama import LlamaDecoderLayer as BaseLlamaDecoderLayer
from minivllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel as BaseLlamaModel
from minivllm.model_executor.models.llama_eagle import eagle_fc

from .utils import (AutoWeightsLoader, WeightsMapper, get_draft_quant_config, maybe_prefix,
                    process_eagle_weight)


class LlamaDecoderLayer(BaseLlamaDecoderLayer):
    """Layer 0 of the head takes [embedding, feature] (2H) into attention; the others are
    Llama's blocks. All are built with the draft's quantization."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None,
                 layer_idx: int = 0) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config)
        config = config or vllm_config.model_config.hf_config
        self.layer_idx = layer_idx
        attn = self.self_attn
        in_size = 2 * self.hidden_size if layer_idx == 0 else self.hidden_size
        attn.qkv_proj = QKVParallelLinear(in_size, attn.head_dim, attn.total_num_heads,
                                          attn.total_num_kv_heads,
                                          bias=getattr(config, "attention_bias", False),
                                          quant_config=self.get_quant_config(vllm_config),
                                          prefix=maybe_prefix(prefix, "self_attn.qkv_proj"))
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Some heads keep the normed feature as the residual (`norm_before_residual`).
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def get_quant_config(self, vllm_config: VllmConfig) -> QuantizationConfig | None:
        return get_draft_quant_config(vllm_config)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor,
                hidden_states: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_idx == 0:
            normed = self.hidden_norm(hidden_states)
            residual = normed if self.norm_before_residual else hidden_states
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)     # [T, 2H]
        else:
            x, residual = self.input_layernorm(hidden_states, residual)
        x = self.self_attn(positions=positions, hidden_states=x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0,
                                         "input_embeds": 0})
class LlamaModel(nn.Module):
    """The head's layers, its fc over the target's features and its final norm."""

    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_substr={"midlayer.": "layers.0."},
        orig_to_new_stacked=BaseLlamaModel.hf_to_vllm_mapper.orig_to_new_stacked)

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int = 0,
                 prefix: str = "") -> None:
        super().__init__()
        self.config = config = vllm_config.speculative_config.draft_model_config.hf_config
        self.vocab_size = config.vocab_size
        self.quant_config = get_draft_quant_config(vllm_config)
        eagle_config = getattr(config, "eagle_config", None) or {}
        self.use_aux_hidden_state = eagle_config.get("use_aux_hidden_state", True)
        self.norm_before_fc = bool(eagle_config.get("norm_before_fc",
                                                    getattr(config, "norm_before_fc", False)))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        current = get_current_vllm_config()
        self.layers = nn.ModuleList([
            LlamaDecoderLayer(current, config=config, layer_idx=i,
                              prefix=maybe_prefix(prefix, f"layers.{start_layer_id + i}"))
            for i in range(config.num_hidden_layers)])
        if self.use_aux_hidden_state:
            self._build_fc(vllm_config, config, eagle_config, prefix)
        self.norm_output = getattr(config, "norm_output", False)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _build_fc(self, vllm_config: VllmConfig, config, eagle_config: dict,
                  prefix: str) -> None:
        """fc [n * H_target -> H] and its optional norms (one over the whole concatenation,
        `norm_before_fc`, or one per target layer, `fc_norm`)."""
        n = getattr(config, "num_aux_hidden_states", None)
        if n is None:
            ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
            n = len(ids) if ids else 3
        self.num_aux_hidden_states = n
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc_input_size = n * target_hidden
        self.input_norm = (RMSNorm(self.fc_input_size, eps=config.rms_norm_eps)
                           if self.norm_before_fc else None)
        self.fc_norm = (nn.ModuleList([RMSNorm(target_hidden, eps=config.rms_norm_eps)
                                       for _ in range(n)])
                        if getattr(config, "fc_norm", False) else None)
        self.fc = eagle_fc(vllm_config, self.fc_input_size, config.hidden_size,
                           self.quant_config, prefix)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, input_embeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [T, H]: fc's output (first draft step) or the head's own pre-norm
        features. Returns (normed features for the LM head, features for the next step)."""
        embeds = self.embed_input_ids(input_ids) if input_embeds is None else input_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions=positions, embeds=embeds,
                                            hidden_states=hidden_states, residual=residual)
        normed, prenorm = self.norm(hidden_states, residual)
        return normed, normed if self.norm_output else prenorm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


class Eagle3LlamaForCausalLM(LlamaForCausalLM):
    """The head with its own LM head over `draft_vocab_size` ids (and `draft_id_to_target_id`,
    the checkpoint's d2t, where that is smaller than the target's vocabulary)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)     # not Llama's body: the head builds its own parts
        self.config = config = vllm_config.speculative_config.draft_model_config.hf_config
        if getattr(config, "draft_vocab_size", None) is None:
            config.draft_vocab_size = config.vocab_size
        num_target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        config.target_layer_count = num_target_layers   # layer_types count from the head's
        self.model = LlamaModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                start_layer_id=num_target_layers)
        quant_config = get_draft_quant_config(vllm_config)
        self.lm_head = ParallelLMHead(config.draft_vocab_size, config.hidden_size,
                                      quant_config=quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.draft_vocab_size,
                                                scale=getattr(config, "logit_scale", 1.0))
        self.draft_id_to_target_id = None
        if config.draft_vocab_size != vllm_config.model_config.get_vocab_size():
            self.draft_id_to_target_id = nn.Parameter(
                torch.zeros(config.draft_vocab_size, dtype=torch.long), requires_grad=False)
        if vllm_config.speculative_config.parallel_drafting:
            raise ValueError("parallel drafting is not supported by minivllm")

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None,
                        is_multimodal=None) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, inputs_embeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, hidden_states, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[T, H] -> [T, V_target]: the draft vocabulary's logits placed at their target ids."""
        logits = self.logits_processor(self.lm_head, hidden_states)      # [T, V_draft]
        if self.draft_id_to_target_id is None:
            return logits
        target_ids = torch.arange(logits.shape[-1], device=logits.device) \
            + self.draft_id_to_target_id
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, target_ids] = logits
        return full

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's aux features [T, n * H_target] -> [T, H] (as they are when the head
        reads no aux layers)."""
        model = self.model
        if not model.use_aux_hidden_state:
            return hidden_states
        if model.input_norm is not None:
            hidden_states = model.input_norm(hidden_states)
        if model.fc_norm is not None:
            chunks = hidden_states.chunk(model.num_aux_hidden_states, dim=-1)
            hidden_states = torch.cat([norm(c) for norm, c in zip(model.fc_norm, chunks)], -1)
        return model.fc(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names without `model.`; `d2t` is the id map, `t2d` (the inverse) unused."""
        renamed = []
        for name, tensor in weights:
            if "t2d" in name:
                continue
            if "d2t" in name:
                if self.draft_id_to_target_id is None:
                    continue      # the draft vocabulary is the target's: no map needed
                name = name.replace("d2t", "draft_id_to_target_id")
            elif "lm_head" not in name:
                name = "model." + name
            process_eagle_weight(self, name)
            renamed.append((name, tensor))
        return AutoWeightsLoader(self).load_weights(renamed)
