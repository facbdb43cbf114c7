"""Decode steps replayed from CPU graphs (`compilation/cpu_graph.py`): static inputs per batch size.

A decode-only step of B sequences (one token each, B <= `max_cudagraph_capture_size`) runs the
model on this size's static buffers: the first such step captures the graph while it runs (its
output is real), later ones copy their inputs into the buffers and replay. A size whose capture
is refused (some op of the step is not a native kernel) stays eager; after two refusals the
model is taken to be unsuitable and no further size is tried.
"""

from dataclasses import dataclass

import torch

from minivllm import _custom_ops as ops
from minivllm.compilation.cpu_graph import CPUGraph
from minivllm.config import CompilationMode, CUDAGraphMode, VllmConfig
from minivllm.forward_context import BatchDescriptor, set_forward_context
from minivllm.logger import init_logger
from minivllm.model_executor.layers.attention.backends.cpu_attn_metadata import (
    CommonAttentionMetadata, TorchAttentionMetadataBuilder)
from minivllm.worker.input_batch import StepInputs

logger = init_logger(__name__)
_MAX_REFUSALS = 2


@dataclass
class _Entry:
    """One batch size's graph and the buffers its recorded calls read and write."""

    graph: CPUGraph
    input_ids: torch.Tensor      # int64 [B]
    positions: torch.Tensor      # int64 [B]
    slot_mapping: torch.Tensor   # int64 [B]
    seq_lens: torch.Tensor       # int32 [B]
    block_table: torch.Tensor    # int32 [B, max_blocks_per_seq]
    output: torch.Tensor | None = None
    metadata: object = None      # kept alive: the decode kernel reads its tensors


class CPUGraphRunner:
    """Captures and replays one graph per decode batch size for a model of one rank."""

    def __init__(self, vllm_config: VllmConfig, builder: TorchAttentionMetadataBuilder,
                 attn_layer_names: list[str]) -> None:
        cc = vllm_config.compilation_config
        self.vllm_config = vllm_config
        self.builder = builder
        self.attn_layer_names = attn_layer_names
        self.max_size = cc.max_cudagraph_capture_size
        self.enabled = (cc.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
                        and cc.mode == CompilationMode.NONE and self.max_size > 0
                        and vllm_config.parallel_config.world_size == 1
                        and torch.device(vllm_config.device_config.device).type == "cpu"
                        and ops.native_available())   # without kernels nothing is replayable
        block_size = vllm_config.cache_config.block_size
        self.max_blocks = -(-vllm_config.model_config.max_model_len // block_size)
        self.entries: dict[int, _Entry] = {}
        self.refused: set[int] = set()
        self.num_replays = 0

    def reset(self) -> None:
        """Drop every graph (the KV cache or the weights they point at were replaced)."""
        self.entries.clear()
        self.refused.clear()

    def can_run(self, inputs: StepInputs) -> bool:
        num_reqs = len(inputs.req_ids)
        return (self.enabled and 0 < num_reqs <= self.max_size
                and len(inputs.input_ids) == num_reqs and num_reqs not in self.refused
                and inputs.block_table.shape[1] <= self.max_blocks)

    def run(self, model: torch.nn.Module, inputs: StepInputs) -> torch.Tensor:
        """The step's hidden states [B, H] (valid until the next step of this size): replayed,
        or computed by the capture run (whether or not the capture was accepted)."""
        num_reqs = len(inputs.req_ids)
        entry = self.entries.get(num_reqs)
        if entry is not None:
            self._fill(entry, inputs)
            entry.graph.replay()
            self.num_replays += 1
            return entry.output
        entry = self._new_entry(num_reqs)
        self._fill(entry, inputs)
        output = self._capture(model, entry)
        if entry.graph.ok:
            self.entries[num_reqs] = entry
        else:
            self._refuse(num_reqs, entry.graph.refused)
        return output

    def _capture(self, model: torch.nn.Module, entry: _Entry) -> torch.Tensor:
        num_reqs = entry.input_ids.shape[0]
        common = CommonAttentionMetadata(
            query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32),
            seq_lens=entry.seq_lens, block_table=entry.block_table,
            slot_mapping=entry.slot_mapping, num_actual_tokens=num_reqs, max_query_len=1,
            max_seq_len=int(entry.seq_lens.max()))
        entry.metadata = self.builder.build_for_cudagraph_capture(common)
        slot_mapping = {name: entry.slot_mapping for name in self.attn_layer_names}
        batch = BatchDescriptor(num_reqs, num_reqs, uniform=True)     # decode rows only
        with set_forward_context(entry.metadata, self.vllm_config, slot_mapping=slot_mapping,
                                 batch_descriptor=batch):
            with entry.graph.capture():
                output = model(input_ids=entry.input_ids, positions=entry.positions,
                               intermediate_tensors=None)
        if not isinstance(output, torch.Tensor):
            entry.graph.refuse("the model returned no single hidden-states tensor")
        entry.output = output
        return output

    def _new_entry(self, num_reqs: int) -> _Entry:
        return _Entry(graph=CPUGraph(), input_ids=torch.zeros(num_reqs, dtype=torch.int64),
                      positions=torch.zeros(num_reqs, dtype=torch.int64),
                      slot_mapping=torch.zeros(num_reqs, dtype=torch.int64),
                      seq_lens=torch.ones(num_reqs, dtype=torch.int32),
                      block_table=torch.zeros(num_reqs, self.max_blocks, dtype=torch.int32))

    @staticmethod
    def _fill(entry: _Entry, inputs: StepInputs) -> None:
        entry.input_ids.copy_(inputs.input_ids)
        entry.positions.copy_(inputs.positions)
        entry.slot_mapping.copy_(inputs.slot_mapping)
        entry.seq_lens.copy_(inputs.seq_lens)
        entry.block_table[:, :inputs.block_table.shape[1]].copy_(inputs.block_table)

    def _refuse(self, num_reqs: int, reason: str | None) -> None:
        self.refused.add(num_reqs)
        if len(self.refused) >= _MAX_REFUSALS:
            self.enabled = False
            logger.info("CPU graphs are off for this model: %s during capture (steps run "
                        "eagerly)", reason)
        else:
            logger.debug("CPU graph of %d sequences refused: %s", num_reqs, reason)
