"""Helpers of the scheduler (vLLM keeps these in `v1/core/sched/utils.py`)."""

from __future__ import annotations

from minivllm.engine.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Token-level stop conditions, in vLLM's order; stop strings are the engine's."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if ((params.max_tokens is not None and request.num_output_tokens >= params.max_tokens)
            or request.num_tokens >= max_model_len):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def has_prefix_lm_layers(vllm_config: object) -> bool:
    """Whether the model built in this process has prefix-LM (`non_causal`) attention layers,
    whose prefills must run whole; the engine then builds its scheduler with `whole_prefills`.
    NOTE: with TP or PP > 1 the layers live in the worker processes and this is False; those
    layers refuse a split prefill themselves."""
    compilation_config = getattr(vllm_config, "compilation_config", None)
    layers = getattr(compilation_config, "static_forward_context", None) or {}
    return any(getattr(layer, "non_causal", False) for layer in layers.values())
