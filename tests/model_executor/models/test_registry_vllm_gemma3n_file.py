"""vLLM 0.33.0's own gemma3n.py (`Gemma3nForCausalLM`) on minivllm, against transformers'
Gemma 3n: AltUp, Laurel, per-layer inputs, gaussian top-k activation sparsity
(`GeluAndMulSparse`), sliding / full layers, q / k / v norms, KV-sharing last layers, final
logit soft-capping; whole prompts and chunks of 8 (the file comes from vLLM's source
distribution, see `_vllm_files`).

vLLM serves Gemma 3n through `Gemma3nForConditionalGeneration` (gemma3n_mm.py), which looks up
the per-layer token embeddings and hands them to this file's `forward` as `per_layer_inputs`.
Run alone (as here), the file gets none and builds each layer's input from the projection of
the token embeddings only: what transformers computes when it is given `inputs_embeds` and no
`per_layer_inputs`. The reference runs transformers that way; minivllm's own gemma3n.py
(test_gemma3n.py) matches transformers from token ids, per-layer vocabulary included.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM
from tests.model_executor.models._family_helpers import build_model, minivllm_greedy
from tests.model_executor.models.test_gemma3n import (NUM_TOKENS, PROMPTS,
                                                      write_gemma3n_checkpoint)


@torch.inference_mode()
def _hf_greedy_from_embeddings(path: str) -> list[tuple[list[int], torch.Tensor]]:
    """`hf_greedy`, with transformers fed the (scaled) token embeddings instead of the ids."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    embed = model.get_input_embeddings()

    def logits(seq: list[int]) -> torch.Tensor:      # [len(seq), vocab]
        return model(inputs_embeds=embed(torch.tensor([seq])), use_cache=False).logits[0]

    results = []
    for ids in PROMPTS:
        seq = list(ids)
        for _ in range(NUM_TOKENS):
            seq.append(int(logits(seq)[-1].argmax()))
        logprobs = torch.log_softmax(logits(seq).double(), -1)
        chosen = logprobs[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        results.append((seq[len(ids):], chosen))
    return results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, list]:
    path = write_gemma3n_checkpoint(tmp_path_factory.mktemp("vllm_gemma3n"))
    return path, _hf_greedy_from_embeddings(path)


@pytest.mark.parametrize("budget", [512, 8])
def test_vllm_gemma3n_file_matches_transformers(checkpoint, registered_vllm_class, budget):
    cls = registered_vllm_class("gemma3n", "Gemma3nForCausalLM", None)
    path, reference = checkpoint
    if budget == 512:
        model = build_model(path)
        assert type(model) is cls and "._checked_gemma3n_" in cls.__module__
        # The sparse gate is where the config asks for it, and only there.
        acts = [type(layer.mlp.act_fn).__name__ for layer in model.model.layers]
        assert acts == ["GeluAndMulSparse"] * 2 + ["GeluAndMul"] * 3
    llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=budget)
    ours = minivllm_greedy(llm, PROMPTS, NUM_TOKENS)
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(zip(ours, reference)):
        assert tokens == ref_tokens, f"prompt {i}: tokens differ from transformers"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= 1e-4, f"prompt {i}: logprobs differ by {diff:.3g} (> 1e-4)"
    if budget == 8:     # the KV-sharing layers read their targets' caches
        attn = llm.llm_engine.executor.worker.model_runner.attn_layers
        assert attn["model.layers.3.self_attn.attn"].kv_cache is \
            attn["model.layers.1.self_attn.attn"].kv_cache
        assert attn["model.layers.4.self_attn.attn"].kv_cache is \
            attn["model.layers.2.self_attn.attn"].kv_cache
