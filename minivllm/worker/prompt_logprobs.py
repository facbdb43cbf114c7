"""Prompt logprobs: for each prompt position of a step's chunks, the logprob (and rank) of the
prompt's next token, and the top-k alternatives, as vLLM's `prompt_logprobs` returns them."""

import torch

from minivllm.worker.input_batch import CachedRequestState, StepInputs


def prompt_logprobs(model: torch.nn.Module, states: dict[str, CachedRequestState],
                    inputs: StepInputs, hidden: torch.Tensor) -> dict[str, list]:
    """For prompt positions p of this chunk with p + 1 < prompt length: logprob of token p+1."""
    rows, targets, owners, max_k = [], [], [], 0
    for b, req_id in enumerate(inputs.req_ids):
        state = states[req_id]
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        start = inputs.num_computed[b]
        end = min(start + inputs.query_lens[b], state.num_prompt_tokens - 1)
        if end <= start:
            continue
        first = int(inputs.query_start_loc[b])
        rows.extend(range(first, first + end - start))
        targets.extend(state.token_ids[start + 1:end + 1])
        owners.append((req_id, end - start, k))
        max_k = max(max_k, k)
    if not rows:
        return {}
    logprobs = torch.log_softmax(model.compute_logits(hidden[rows]).float(), dim=-1)
    target = torch.tensor(targets)
    target_lp = logprobs.gather(1, target[:, None])                   # [R, 1]
    ranks = (logprobs > target_lp).sum(-1) + 1                         # [R]
    top_lp, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (logprobs[:, :0], target[:, None][:, :0])
    entries = _rows_to_entries(target.tolist(), target_lp[:, 0].tolist(), ranks.tolist(),
                               top_ids.tolist(), top_lp.tolist())
    result, pos = {}, 0
    for req_id, count, k in owners:
        result[req_id] = [e[:k + 1] for e in entries[pos:pos + count]]
        pos += count
    return result


def _rows_to_entries(tokens: list[int], lps: list[float], ranks: list[int],
                     top_ids: list[list[int]], top_lps: list[list[float]]) -> list[list[tuple]]:
    return [[(t, lp, r)] + [(i, l, j + 1) for j, (i, l) in enumerate(zip(ti, tl))]
            for t, lp, r, ti, tl in zip(tokens, lps, ranks, top_ids, top_lps)]
