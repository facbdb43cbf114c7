"""The forward context: how layers find per-step data (attention metadata, slot mappings).

Only the model runner sets it, with `set_forward_context(...)`; layers read it with
`get_forward_context()`. Contexts do not nest.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

from minivllm.config import CUDAGraphMode, VllmConfig


class BatchDescriptor(NamedTuple):
    """The shape of a step's batch (vLLM's fields): num_tokens scheduled, num_reqs requests,
    uniform when every request has the same query length (the model runners set it for
    decode-only steps: one token each), has_lora."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False


@dataclass
class ForwardContext:
    """What `set_forward_context` publishes; the fields are vLLM's (contract §3.2). vLLM's
    data-parallel and MoE fields (`dp_metadata`, `all_moe_layers`, ...) come with those features."""

    no_compile_layers: dict[str, Any]          # the static forward context: prefix -> layer
    attn_metadata: Any                         # dict layer -> metadata, list of dicts, object or None
    slot_mapping: dict[str, Any] | list = field(default_factory=dict)
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE   # minivllm captures no CUDA graphs
    batch_descriptor: Any = None
    ubatch_slices: Any = None
    is_padding: Any = None
    skip_compiled: bool = False                # run the compiled model eagerly for this step
    # hybrid models: where each sequence's recurrent state lives (ShortConvAttentionMetadata)
    state_metadata: Any = None
    # minivllm: every request brings only its last token and its draft tokens (a decode step
    # of speculative decoding); kernels that treat decode steps apart read it
    # (`is_decode_only_step`)
    decode_with_drafts: bool = False


_forward_context: ForwardContext | None = None


def create_forward_context(attn_metadata: Any, vllm_config: VllmConfig, slot_mapping: Any = None,
                           skip_compiled: bool = False, is_padding: Any = None,
                           **kwargs: Any) -> ForwardContext:
    return ForwardContext(no_compile_layers=vllm_config.compilation_config.static_forward_context,
                          attn_metadata=attn_metadata,
                          slot_mapping={} if slot_mapping is None else slot_mapping,
                          skip_compiled=skip_compiled, is_padding=is_padding, **kwargs)


@contextlib.contextmanager
def override_forward_context(ctx: ForwardContext | None) -> Iterator[None]:
    global _forward_context
    prev = _forward_context
    _forward_context = ctx
    try:
        yield
    finally:
        _forward_context = prev


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any, vllm_config: VllmConfig, num_tokens: int | None = None,
                        num_tokens_across_dp: Any = None,
                        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
                        batch_descriptor: Any = None, ubatch_slices: Any = None,
                        slot_mapping: Any = None, skip_compiled: bool = False,
                        is_padding: Any = None, state_metadata: Any = None,
                        decode_with_drafts: bool = False) -> Iterator[None]:
    """Publish one step's metadata to every layer for the duration of the forward pass."""
    assert _forward_context is None, "set_forward_context must not be nested"
    ctx = create_forward_context(attn_metadata, vllm_config, slot_mapping=slot_mapping,
                                 skip_compiled=skip_compiled, is_padding=is_padding,
                                 cudagraph_runtime_mode=cudagraph_runtime_mode,
                                 batch_descriptor=batch_descriptor, ubatch_slices=ubatch_slices,
                                 state_metadata=state_metadata,
                                 decode_with_drafts=decode_with_drafts)
    with override_forward_context(ctx):
        yield


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, (
        "Forward context is not set. Run the model inside `set_forward_context(...)`.")
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


def is_decode_only_step() -> bool:
    """True inside a forward pass whose requests each bring one token (a decode step), or
    their last token and their draft tokens (a decode step with speculation)."""
    ctx = _forward_context
    if ctx is None:
        return False
    batch = ctx.batch_descriptor
    return ctx.decode_with_drafts or (batch is not None and batch.uniform
                                      and batch.num_tokens == batch.num_reqs)


def is_prompt_step() -> bool:
    """True inside a forward pass that is not `is_decode_only_step` (some request brings
    prompt tokens); False outside any forward pass."""
    return _forward_context is not None and not is_decode_only_step()


def in_piecewise_cudagraph() -> bool:
    return False
