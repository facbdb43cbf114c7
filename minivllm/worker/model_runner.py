"""The model runner: scheduler output -> flat inputs + forward context -> model -> logits -> tokens."""

import torch

from minivllm.config import CompilationMode, VllmConfig
from minivllm.forward_context import BatchDescriptor, set_forward_context
from minivllm.logger import init_logger
from minivllm.lora.worker_manager import WorkerLoRAManager
from minivllm.model_executor.layers.attention.backends.cpu_attn_metadata import (
    CommonAttentionMetadata, TorchAttentionMetadataBuilder)
from minivllm.model_executor.layers.mamba.abstract import is_mamba_layer
from minivllm.model_executor.model_loader import get_model
from minivllm.model_executor.models.interfaces import needs_state_slots
from minivllm.sequence import IntermediateTensors
from minivllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.v1.sample.logits_processor import LogitsProcessorBatch, build_logitsprocs
from minivllm.v1.spec_decode.ngram_proposer import NgramProposer
from minivllm.worker import hugepages
from minivllm.worker.cpu_graph_runner import CPUGraphRunner
from minivllm.worker.draft_model_proposer import DraftModelProposer
from minivllm.worker.eagle_proposer import EagleProposer
from minivllm.worker.input_batch import (CachedRequestState, StepInputs, as_decode_rows,
                                         check_prompt_embeds_support, is_decode_with_drafts,
                                         prepare_inputs, step_inputs_embeds, update_states)
from minivllm.worker.kv_budget import default_kv_bytes
from minivllm.worker.pooling import PoolingRunner
from minivllm.worker.prompt_logprobs import prompt_logprobs
from minivllm.worker.rejection_sampler import verify_drafts
from minivllm.worker.sampler import RequestSamplingStates, Sampler
from minivllm.worker.state_slots import StateSlots

logger = init_logger(__name__)
class ModelRunner:
    """Holds the model, its KV cache and per-request state of one rank."""

    def __init__(self, vllm_config: VllmConfig, device: str | torch.device = "cpu") -> None:
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.block_size = vllm_config.cache_config.block_size
        self.states: dict[str, CachedRequestState] = {}
        self.sampling_states = RequestSamplingStates(self.device)
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.attn_builder = TorchAttentionMetadataBuilder(self.block_size)
        self.cpu_graphs: CPUGraphRunner | None = None
        self.lora_manager: WorkerLoRAManager | None = None
        self.pooling: PoolingRunner | None = None   # set for pooling models: pool, never sample
        self.state_slots: StateSlots | None = None   # models with recurrent state
        # speculative decoding's proposer
        self.drafter: NgramProposer | DraftModelProposer | EagleProposer | None = None
        self.logitsprocs: LogitsProcessorBatch | None = None   # custom logits processors
        self.enable_prompt_embeds = False   # steps may carry prompt embeddings (load_model)

    def load_model(self) -> None:
        self.model = get_model(vllm_config=self.vllm_config)
        if self.device.type == "cpu":
            hugepages.rehome_parameters(self.model)
        self.vocab_size = self.vllm_config.model_config.get_vocab_size()
        lora_config = self.vllm_config.lora_config
        if lora_config is not None:
            # Wrapped after loading: the LoRA layers keep the loaded base layers inside.
            self.lora_manager = WorkerLoRAManager(self.model, lora_config,
                                                  self.vllm_config.model_config.dtype)
        if getattr(self.model, "is_pooling_model", False):
            self.pooling = PoolingRunner(self.model.pooler)
        self.logitsprocs = build_logitsprocs(self.vllm_config, self.device)
        self.enable_prompt_embeds = check_prompt_embeds_support(self.model,
                                                                self.vllm_config.model_config)
        if needs_state_slots(self.model):
            self.state_slots = StateSlots(self.vllm_config.scheduler_config.max_num_seqs)
            for layer in self.mamba_layers.values():    # vLLM-style layers: states on kv_cache
                layer.bind_state_slots(self.state_slots.num_slots, self.device)
        spec = self.vllm_config.speculative_config
        if spec is not None:
            if self.state_slots is not None:
                raise ValueError("speculative decoding needs a model whose layers keep their "
                                 "state in the paged KV cache; this one has recurrent-state "
                                 "layers, which cannot take back rejected drafts")
            if spec.method == "ngram":
                self.drafter = NgramProposer(spec.num_speculative_tokens,
                                             spec.prompt_lookup_min, spec.prompt_lookup_max)
            elif spec.use_eagle:
                if self.enable_prompt_embeds:
                    raise ValueError("EAGLE drafts from token ids; prompt embeddings "
                                     "(enable_prompt_embeds) cannot be used with it")
                self.drafter = EagleProposer(self.vllm_config, self.model, self.step_context)
            else:   # its layers join the static forward context: KV caches come with them
                self.drafter = DraftModelProposer(self.vllm_config, self.run_model)
                if self.device.type == "cpu":
                    hugepages.rehome_parameters(self.drafter.model)

    def lora_manager_or_raise(self) -> WorkerLoRAManager:
        if self.lora_manager is None:
            raise ValueError("LoRA is disabled for this engine: create it with enable_lora=True "
                             "(--enable-lora)")
        return self.lora_manager

    @property
    def attn_layers(self) -> dict:
        """The paged-KV attention layers of the static forward context."""
        return {name: layer for name, layer in self.static_layers.items()
                if not is_mamba_layer(layer)}

    @property
    def mamba_layers(self) -> dict:
        """Recurrent-state layers registered there as vLLM's are (`mamba/abstract.py`)."""
        return {name: layer for name, layer in self.static_layers.items()
                if is_mamba_layer(layer)}

    @property
    def static_layers(self) -> dict:
        return self.vllm_config.compilation_config.static_forward_context

    def kv_cache_bytes_per_block(self) -> int:
        total = 0
        for layer in self.attn_layers.values():
            if _kv_sharing_target(layer) is not None:      # reads another layer's cache
                continue
            shape = layer.get_kv_cache_shape(1, self.block_size)
            total += torch.Size(shape).numel() * layer.kv_cache_torch_dtype.itemsize
        return total

    def determine_num_blocks(self) -> int:
        cache_config = self.vllm_config.cache_config
        if cache_config.num_gpu_blocks_override is not None:
            return cache_config.num_gpu_blocks_override
        per_block = self.kv_cache_bytes_per_block()
        if per_block == 0:
            # Attention-free (Mamba): blocks cost nothing, but the scheduler still accounts
            # sequences in blocks; enough for every sequence at full length.
            sched = self.vllm_config.scheduler_config
            max_len = self.vllm_config.model_config.max_model_len
            return sched.max_num_seqs * -(-max_len // self.block_size)
        budget = cache_config.kv_cache_memory_bytes or default_kv_bytes(
            self.device, cache_config.gpu_memory_utilization)
        return max(1, budget // per_block)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one paged cache per attention layer of this stage and bind it to the layer;
        a KV-sharing layer (`kv_sharing_target_layer_name`, Gemma 4's last layers) is bound to
        its target's cache, which it reads and never writes."""
        layers = [layer for layer in self.attn_layers.values()
                  if _kv_sharing_target(layer) is None]
        shapes = [(torch.Size(layer.get_kv_cache_shape(num_blocks, self.block_size)),
                   layer.kv_cache_torch_dtype) for layer in layers]
        # Zeroed so that masked-out slots can never feed NaNs into attention.
        if self.device.type == "cpu":
            caches = hugepages.zeros(shapes)
        else:
            caches = [torch.zeros(s, dtype=d, device=self.device) for s, d in shapes]
        for layer, cache in zip(layers, caches):
            layer.bind_kv_cache(cache)
        self._bind_shared_kv_caches()
        self.num_blocks = num_blocks
        # Graphs record data pointers: built (or rebuilt) against this cache.
        self.cpu_graphs = CPUGraphRunner(self.vllm_config, self.attn_builder,
                                         list(self.attn_layers))
        if self.state_slots is not None:
            # A replayed step could not give the recurrent-state layers their slots.
            self.cpu_graphs.enabled = False
        if isinstance(self.drafter, DraftModelProposer):
            self.drafter.bind_graphs(self.attn_builder, list(self.attn_layers))

    def _bind_shared_kv_caches(self) -> None:
        """Each KV-sharing layer gets its target's cache (same block table, same slots)."""
        for name, layer in self.attn_layers.items():
            target = _kv_sharing_target(layer)
            if target is None:
                continue
            owner = self.attn_layers.get(target)
            if owner is None or _kv_sharing_target(owner) is not None:
                raise ValueError(f"{name} shares the KV cache of {target!r}, which is not a "
                                 f"cache-owning attention layer of this stage")
            layer.bind_kv_cache(owner.kv_cache)

    @torch.inference_mode()
    def compile_or_warm_up_model(self) -> None:
        """With torch.compile on, compile now so that no request waits for it.

        One dummy forward with more than `eager_max_tokens` tokens builds the graph with a
        dynamic token count that serves every larger step (smaller ones run eagerly), and one
        with a single token its specialised graph when one-token steps are compiled too.
        """
        config = self.vllm_config
        if (config.compilation_config.mode == CompilationMode.NONE
                or config.parallel_config.world_size > 1):
            return        # eager; or several ranks, which compile on their first step together
        eager_max = config.compilation_config.eager_max_tokens
        max_tokens = config.scheduler_config.max_num_batched_tokens
        if max_tokens <= eager_max:
            return
        # 2 at least: dynamo specialises a size of 1, so that graph would serve nothing else.
        num_tokens = max(eager_max + 1, min(16, max_tokens), 2)
        for n in [num_tokens] + ([1] if eager_max < 1 else []):
            with set_forward_context(None, config, slot_mapping={}):
                self.model(input_ids=torch.zeros(n, dtype=torch.long, device=self.device),
                           positions=torch.arange(n, device=self.device), intermediate_tensors=None)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, intermediate_tensors: IntermediateTensors | None = None
                      ) -> ModelRunnerOutput | IntermediateTensors:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = prepare_inputs(self.states, so, self.block_size)
        if self.lora_manager is not None:
            self.lora_manager.set_active_adapters(
                [self.states[r].lora_request for r in inputs.req_ids], inputs.query_lens)
        hidden = self._forward(inputs, intermediate_tensors)
        if isinstance(hidden, IntermediateTensors):
            return hidden
        if self.pooling is not None:
            return self.pooling.pool(inputs, hidden)
        features = None     # what an EAGLE head reads of the target's step
        if isinstance(self.drafter, EagleProposer):
            hidden, features = self.drafter.target_features(hidden)
        return self.sample(inputs, hidden, so.grammar_output, so.scheduled_spec_decode_tokens,
                           features)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.sampling_states.remove(req_id)
            if self.logitsprocs is not None:
                self.logitsprocs.remove_request(req_id)
        if self.pooling is not None:
            self.pooling.drop(so.finished_req_ids | so.preempted_req_ids)
        if self.state_slots is not None:
            self.state_slots.release(so.finished_req_ids | so.preempted_req_ids)
        if self.drafter is not None:
            self.drafter.remove(so.finished_req_ids | so.preempted_req_ids)
        update_states(self.states, so)
        for new in so.scheduled_new_reqs:
            # A request resumed after preemption keeps its sampling state (seeded generator).
            if new.req_id not in self.sampling_states:
                # An embeds prompt's ids are stand-ins: penalties and processors see no prompt.
                prompt = new.prompt_token_ids if new.prompt_embeds is None else []
                self.sampling_states.add(new.req_id, new.sampling_params, prompt,
                                         new.output_token_ids)
                if self.logitsprocs is not None:
                    self.logitsprocs.add_request(new.req_id, new.sampling_params, prompt,
                                                 new.output_token_ids)

    def _forward(self, inputs: StepInputs, intermediate_tensors: IntermediateTensors | None):
        # Every request runs its last token and its drafts (the rows it samples): decode-like.
        # Attention then sees each row as a one-token sequence of its own length (the native
        # decode kernel re-reads a few rows' keys instead of gathering them for SDPA), so the
        # decode graph of that many rows replays the step.
        with_drafts = is_decode_with_drafts(inputs)
        rows = as_decode_rows(inputs) if with_drafts else inputs
        embeds = None   # PP: only the first stage (no intermediate tensors) embeds
        if self.enable_prompt_embeds and intermediate_tensors is None:
            embeds = step_inputs_embeds(self.model, self.states, inputs, self.device)
        hidden = self.run_model(self.model, self.cpu_graphs, rows, inputs, intermediate_tensors,
                                with_drafts, embeds)
        if isinstance(self.drafter, DraftModelProposer):
            self.drafter.mirror(rows, inputs, with_drafts)
        return hidden

    def run_model(self, model: torch.nn.Module, graphs: CPUGraphRunner | None, rows: StepInputs,
                  inputs: StepInputs, intermediate_tensors: IntermediateTensors | None,
                  with_drafts: bool, inputs_embeds: torch.Tensor | None = None):
        """One forward of `model` (the target, or the draft) over a step: replayed from `graphs`
        where they can, else eagerly with the step's attention metadata built from `rows`."""
        if graphs is not None and intermediate_tensors is None and inputs_embeds is None \
                and graphs.can_run(rows):
            return graphs.run(model, rows)     # CPU, one rank: checked by can_run
        with self.step_context(rows, inputs, with_drafts):
            return model(input_ids=inputs.input_ids.to(self.device),
                         positions=inputs.positions.to(self.device),
                         intermediate_tensors=intermediate_tensors,
                         **({} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}))

    def step_context(self, rows: StepInputs, inputs: StepInputs, with_drafts: bool = False):
        """The forward context of one eager step: attention metadata built from `rows` (the
        sequences attention sees), slots and token counts from `inputs`."""
        common = CommonAttentionMetadata(
            query_start_loc=rows.query_start_loc, seq_lens=rows.seq_lens,
            block_table=rows.block_table, slot_mapping=inputs.slot_mapping,
            num_actual_tokens=len(inputs.input_ids), max_query_len=max(rows.query_lens),
            max_seq_len=max(rows.seq_lens_list))
        attn_metadata = self.attn_builder.build(common)
        slot_mapping = {name: inputs.slot_mapping for name in self.attn_layers}
        num_tokens, num_reqs = len(inputs.input_ids), len(inputs.req_ids)
        batch = BatchDescriptor(num_tokens, num_reqs, uniform=num_tokens == num_reqs)
        state = (None if self.state_slots is None else
                 self.state_slots.metadata(inputs.req_ids, inputs.num_computed,
                                           inputs.query_start_loc))
        if state is not None and self.mamba_layers:
            attn_metadata = self._per_layer_metadata(attn_metadata, state)
        return set_forward_context(attn_metadata, self.vllm_config, slot_mapping=slot_mapping,
                                   batch_descriptor=batch, state_metadata=state,
                                   decode_with_drafts=with_drafts)

    def _per_layer_metadata(self, attn_metadata: object, state: object) -> dict:
        """vLLM's form, layer name -> metadata, for models whose state layers read theirs
        from it: the paged layers share the step's, each state layer gets its backend's
        (built once per backend)."""
        per_layer: dict = dict.fromkeys(self.attn_layers, attn_metadata)
        built: dict = {}
        for name, layer in self.mamba_layers.items():
            backend = layer.get_attn_backend()
            if backend not in built:
                built[backend] = backend.get_builder_cls()().build(state)
            per_layer[name] = built[backend]
        return per_layer

    def sample(self, inputs: StepInputs, hidden: torch.Tensor,
               grammar: GrammarOutput | None = None,
               spec_tokens: dict[str, list[int]] | None = None,
               features: torch.Tensor | None = None) -> ModelRunnerOutput:
        """Logits for the rows that sample, then their tokens (within the grammars' bitmask
        where requests are constrained; drafts verified where scheduled); prompt logprobs if
        asked; the next step's drafts when speculating."""
        sample_ids = [inputs.req_ids[r] for r in inputs.sample_rows]
        sampled_lists: dict[str, list[int]] = {}
        logprob_lists: dict[str, list | None] = {}
        if sample_ids:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, V]
            if inputs.num_draft_tokens is not None:
                drafts = [(spec_tokens or {}).get(r, []) for r in sample_ids]
                tokens, logprobs = verify_drafts(self.sampler, self.sampling_states, logits,
                                                 sample_ids, drafts, grammar)
            else:
                tokens, logprobs = self._sample_tokens(logits, sample_ids, grammar)
            sampled_lists = dict(zip(sample_ids, tokens))
            if logprobs is not None:
                logprob_lists = dict(zip(sample_ids, logprobs))
            for req_id, ids in sampled_lists.items():
                self.states[req_id].token_ids.extend(ids)
        drafts_out = None
        if self.drafter is not None:
            drafts_out = self._propose(inputs, sample_ids, features)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[sampled_lists.get(r, []) for r in inputs.req_ids],
            logprobs=[logprob_lists.get(r) for r in inputs.req_ids] if logprob_lists else None,
            prompt_logprobs=prompt_logprobs(self.model, self.states, inputs, hidden), spec_token_ids=drafts_out)

    def _propose(self, inputs: StepInputs, sample_ids: list[str],
                 features: torch.Tensor | None) -> list[list[int]]:
        """The next step's drafts, one list per request of the step (empty: none)."""
        if isinstance(self.drafter, EagleProposer):
            # Runs in every step, sampling or not: the head's cache follows the target's.
            proposed = self.drafter.propose(inputs, features, self.states, sample_ids)
        elif isinstance(self.drafter, DraftModelProposer):
            proposed = self.drafter.propose(sample_ids, [self.states[r] for r in sample_ids])
        else:
            proposed = self.drafter.propose(sample_ids,
                                            [self.states[r].token_ids for r in sample_ids])
        by_id = dict(zip(sample_ids, proposed))
        return [by_id.get(r, []) for r in inputs.req_ids]

    def _sample_tokens(self, logits: torch.Tensor, sample_ids: list[str],
                       grammar: GrammarOutput | None) -> tuple[list[list[int]], list | None]:
        """One token per row of logits [S, V] (and its logprobs, as a one-token list per row,
        where asked); the sampling states learn the tokens."""
        metadata = self.sampling_states.make_metadata(sample_ids, logits.shape[-1])
        if grammar is not None:
            row_of = {req_id: i for i, req_id in enumerate(sample_ids)}
            metadata.grammar_rows = torch.tensor(
                [row_of[r] for r in grammar.structured_output_request_ids])
            metadata.grammar_bitmask = torch.from_numpy(grammar.grammar_bitmask)
        if self.logitsprocs is not None:
            metadata.logitsprocs = self.logitsprocs.step(sample_ids)
        out = self.sampler(logits, metadata)
        tokens = out.sampled_token_ids.tolist()
        for req_id, token in zip(sample_ids, tokens):
            self.sampling_states.append(req_id, token)
        if self.logitsprocs is not None:
            self.logitsprocs.append_tokens(sample_ids, tokens)
        logprobs = None
        if out.logprobs_tensors is not None:
            logprobs = [None if lp is None else [lp]
                        for lp in out.logprobs_tensors.tolists(metadata.num_logprobs)]
        return [[t] for t in tokens], logprobs


def _kv_sharing_target(layer: object) -> str | None:
    return getattr(layer, "kv_sharing_target_layer_name", None)
