"""The engine's side of pooling requests: which params a runner takes, and the final output.

A pooling request runs as a prompt-only request: it gets `max_tokens=1` and no detokenizer, the
runner pools its whole prompt in the step that computes the prompt's last token (over chunks
when it was prefilled in several), and the scheduler then finishes it and frees its KV blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from minivllm.outputs import PoolingOutput, PoolingRequestOutput
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams
from minivllm.v1.outputs import ModelRunnerOutput


def check_params(params: Any, model_config: Any) -> PoolingParams | None:
    """The request's PoolingParams (validated against the model), None for a generate request;
    a ValueError naming the runner flag when the params do not fit the engine's runner."""
    runner_type = getattr(model_config, "runner_type", "generate")
    if runner_type == "pooling" and not isinstance(params, PoolingParams):
        raise ValueError("This model runs with runner='pooling' (an embedding model): it "
                         "returns embeddings, not text. Use LLM.embed / LLM.encode (or "
                         "/v1/embeddings), or load it with --runner generate if it is a causal LM.")
    if runner_type != "pooling" and isinstance(params, PoolingParams):
        raise ValueError(f"{params.task.capitalize()} requests need a pooling model, but this "
                         "engine runs with runner='generate'. Load it with --runner pooling "
                         "(LLM(runner='pooling')), adding --convert embed (or classify) for a "
                         "causal-LM checkpoint.")
    if isinstance(params, PoolingParams):
        params.verify(model_config)
        return params
    return None


def prompt_only_params() -> SamplingParams:
    """What the scheduler sees of a pooling request: one (placeholder) step after the prompt."""
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


def record_pooled(children: dict[str, Any], runner_output: ModelRunnerOutput) -> None:
    """Keeps each pooled request's vector on its parent (the engine's `_ParentState`)."""
    for req_id, pooled in zip(runner_output.req_ids, runner_output.pooler_output or ()):
        if pooled is not None and req_id in children:
            children[req_id].parent.pooled = pooled


def make_pooling_output(parent: Any, model_config: Any) -> PoolingRequestOutput:
    """A pooled parent's output: its vector, cut to `dimensions` (renormalised when the pooler
    normalises)."""
    params: PoolingParams = parent.pooling_params
    data = torch.from_numpy(parent.pooled)
    if params.task == "classify" and params.use_activation is not False:
        data = classification_activation(data, model_config)
    if params.dimensions is not None:
        data = data[..., :params.dimensions]
        if getattr(getattr(model_config, "pooler_config", None), "normalize", False):
            data = F.normalize(data, p=2, dim=-1)
    return PoolingRequestOutput(request_id=parent.request_id, outputs=PoolingOutput(data),
                                prompt_token_ids=parent.prompt_token_ids, finished=True,
                                num_cached_tokens=max(parent.children[0].request.num_cached_tokens, 0))


def classification_activation(logits: torch.Tensor, model_config: Any) -> torch.Tensor:
    """Class logits `[C]` -> probabilities: sigmoid per class for one label or a multi-label
    model (HF `problem_type`), else softmax (as transformers' losses read them)."""
    hf_config = getattr(model_config, "hf_config", None)
    multi_label = getattr(hf_config, "problem_type", None) == "multi_label_classification"
    if multi_label or logits.shape[-1] == 1:
        return torch.sigmoid(logits.float())
    return torch.softmax(logits.float(), dim=-1)
