"""EAGLE / EAGLE-3 speculation (vLLM's `eagle` and `eagle3` methods): a head reading the
target's hidden states drafts the next tokens greedily; the target verifies them
(worker/rejection_sampler.py).

After each target step, for every request of the step:
1. one head forward over the step's positions j whose next token t_{j+1} is known now (all of
   a prompt chunk; of a verify step, the last known token and the accepted drafts), fed
   (t_{j+1}, target features at j). Its KV lands in the head's paged cache (layers registered
   under `draft_model.`, paged by the target's block tables), so that cache always holds every
   verified position; what rejected drafts left behind is overwritten here before it is read.
   The head's output at the last such position gives draft 1;
2. k - 1 one-token forwards, each fed the previous draft and the head's own features, written
   into lookahead slots the scheduler reserved (`num_lookahead_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from minivllm.config import VllmConfig
from minivllm.model_executor.model_loader import get_model
from minivllm.model_executor.models.interfaces import supports_eagle3
from minivllm.worker import hugepages
from minivllm.worker.draft_model_proposer import DRAFT_PREFIX
from minivllm.worker.input_batch import CachedRequestState, StepInputs, decode_step_inputs

# step_context(rows, inputs) -> the forward context of one eager step
StepContext = Callable[..., Any]


def eagle_vllm_config(vllm_config: VllmConfig) -> VllmConfig:
    """The config the head is built with: the target's model config (the head's files read the
    target's layer count and dtype from it, and the head's own from speculative_config), the
    head's quantization, no LoRA."""
    spec = vllm_config.speculative_config
    return dataclasses.replace(vllm_config, quant_config=spec.draft_quant_config,
                               lora_config=None)


class EagleProposer:
    """Loads the head beside `target`, proposes up to k greedy tokens per sampled request."""

    def __init__(self, vllm_config: VllmConfig, target: torch.nn.Module,
                 step_context: StepContext) -> None:
        spec = vllm_config.speculative_config
        self.method = spec.method
        self.k = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.block_size = vllm_config.cache_config.block_size
        self.step_context = step_context
        self.vllm_config = eagle_vllm_config(vllm_config)
        self.model = get_model(vllm_config=self.vllm_config, model_config=spec.draft_model_config,
                               prefix=DRAFT_PREFIX, eagle_head=True)
        if torch.device(vllm_config.device_config.device).type == "cpu":
            hugepages.rehome_parameters(self.model)    # before the target's parts join it
        self._share_target_parts(target)
        if self.method == "eagle3":
            self._collect_aux_hidden_states(target, spec.draft_model_config.hf_config)

    def _share_target_parts(self, target: torch.nn.Module) -> None:
        """The target's embedding and LM head, where the head's checkpoint has none (vLLM's
        `has_own_embed_tokens` / `has_own_lm_head`)."""
        if not getattr(self.model, "has_own_embed_tokens", False):
            self.model.model.embed_tokens = target.model.embed_tokens
        if not getattr(self.model, "has_own_lm_head", False):
            draft_vocab = getattr(self.model.config, "draft_vocab_size", None)
            if draft_vocab not in (None, self.model.config.vocab_size):
                raise ValueError(f"The EAGLE head drafts over {draft_vocab} ids but its "
                                 "checkpoint has no lm_head to score them")
            self.model.lm_head = target.lm_head

    def _collect_aux_hidden_states(self, target: torch.nn.Module, head_config: Any) -> None:
        """Makes the target return the residual streams EAGLE-3 reads: the head config's
        `eagle_aux_hidden_state_layer_ids`, else the target's default layers."""
        if not supports_eagle3(target):
            raise ValueError(f"{type(target).__name__} does not support EAGLE-3 (it is not "
                             "SupportsEagle3); use method 'eagle', 'draft_model' or 'ngram'")
        eagle_config = getattr(head_config, "eagle_config", None) or {}
        layers = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if not layers:
            layers = target.get_eagle3_default_aux_hidden_state_layers()
        target.set_aux_hidden_state_layers(tuple(layers))

    def target_features(self, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward output -> (hidden [T, H] for its logits, what the head reads:
        that hidden for EAGLE, the aux streams [T, n * H] side by side for EAGLE-3)."""
        if self.method != "eagle3":
            return output, output
        hidden, aux = output
        return hidden, torch.cat(aux, dim=-1)

    def propose(self, inputs: StepInputs, features: torch.Tensor,
                states: dict[str, CachedRequestState], sample_ids: list[str]
                ) -> list[list[int]]:
        """Drafts for `sample_ids` (in that order) after the target's step `inputs` whose
        `target_features` are `features` [T, F]; `states` already hold the sampled tokens."""
        first, last_rows, keep = self._first_pass_inputs(inputs, states)
        features = features[keep]                                              # [T', F]
        if self.method == "eagle3":
            features = self.model.combine_hidden_states(features)             # [T', H]
        with self.step_context(first, first):
            logit_feats, next_feats = self.model(first.input_ids, first.positions, features)
        row_of = {r: i for i, r in enumerate(inputs.req_ids)}
        last = [last_rows[row_of[r]] for r in sample_ids]
        known = [len(states[r].token_ids) for r in sample_ids]
        room = [min(len(states[r].block_ids) * self.block_size, self.max_model_len) - (n - 1)
                for r, n in zip(sample_ids, known)]
        drafts: list[list[int]] = [[] for _ in sample_ids]
        alive = [i for i in range(len(sample_ids)) if room[i] > 0]
        tokens = self._greedy(logit_feats[[last[i] for i in alive]])
        hidden = next_feats[[last[i] for i in alive]]
        for j in range(self.k):
            for i, token in zip(alive, tokens):
                drafts[i].append(token)
            keep_alive = [a for a, i in enumerate(alive) if j + 1 < room[i]]
            alive = [alive[a] for a in keep_alive]
            if j + 1 == self.k or not alive:
                break
            # NOTE: a loop over draft positions (k), each one batched forward of one row per
            # request: draft j + 1 read at position known - 1 + j, fed draft j.
            step = decode_step_inputs([sample_ids[i] for i in alive],
                                      [drafts[i][-1] for i in alive],
                                      [known[i] - 1 + j for i in alive],
                                      [states[sample_ids[i]].block_ids for i in alive],
                                      self.block_size)
            with self.step_context(step, step):
                logit_feats, next_feats = self.model(step.input_ids, step.positions,
                                                     hidden[keep_alive])
            tokens, hidden = self._greedy(logit_feats), next_feats
        return drafts

    def _greedy(self, feats: torch.Tensor) -> list[int]:
        if feats.shape[0] == 0:
            return []
        # fp32 first: torch's bf16 argmax over a [1, 49152] row takes 3x as long (~180 us)
        return self.model.compute_logits(feats).float().argmax(dim=-1).tolist()

    def _first_pass_inputs(self, inputs: StepInputs, states: dict[str, CachedRequestState]
                           ) -> tuple[StepInputs, list[int], torch.Tensor]:
        """The step's rows whose next token is known, as a step of the head: (its inputs,
        each request's last row in it, the target rows kept [T'])."""
        # NOTE: one Python pass over requests (not tokens): list slices of their tokens.
        counts, ids = [], []
        for req_id, start, n in zip(inputs.req_ids, inputs.num_computed, inputs.query_lens):
            tokens = states[req_id].token_ids
            m = min(n, len(tokens) - start - 1)
            counts.append(m)
            ids += tokens[start + 1:start + 1 + m]
        q_lens = torch.tensor(counts, dtype=torch.int64)                       # [B]
        starts = inputs.query_start_loc[:-1].to(torch.int64)                   # [B]
        new_start = torch.zeros(len(counts) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=new_start[1:])
        # keep[t'] = starts[b] + (t' - new_start[b]) for the t'-th kept row, of request b
        keep = (torch.arange(int(new_start[-1])) +
                torch.repeat_interleave(starts - new_start[:-1], q_lens))
        seq_lens = [c + s for c, s in zip(counts, inputs.num_computed)]
        first = dataclasses.replace(
            inputs, input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=inputs.positions[keep], query_start_loc=new_start.to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            slot_mapping=inputs.slot_mapping[keep], query_lens=counts, seq_lens_list=seq_lens,
            sample_rows=[], logits_indices=new_start[1:] - 1, num_draft_tokens=None)
        return first, (new_start[1:] - 1).tolist(), keep

    def remove(self, req_ids: set[str]) -> None:
        """Nothing per request: the head's cache is rewritten from the target's each step."""
