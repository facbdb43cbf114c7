"""vLLM 0.33.0's own phimoe.py and hrm_text.py, import root renamed, run on minivllm against
transformers 5's PhimoeForCausalLM and HrmTextForCausalLM: fp32 greedy tokens identical and
every logprob within 1e-4.

Each file is registered over minivllm's class for its architecture (vLLM's names:
`PhiMoEForCausalLM`, `HrmTextForCausalLM`), so `LLM` builds vLLM's class.
"""

import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, HrmTextConfig, HrmTextForCausalLM

from minivllm import LLM
from tests.model_executor.models._family_helpers import (assert_matches_transformers,
                                                         build_model, make_prompts,
                                                         minivllm_greedy, write_tiny_checkpoint)
from tests.model_executor.models.test_phimoe import write_phimoe_checkpoint
from tests.model_executor.models.test_registry_vllm_more_files import assert_same_greedy_run

# HRM-Text: 2 blocks per stack (H and L), 2 high cycles of 2 low ones: 12 attention calls per
# token, each with its own KV cache. HF's runtime class is multi-head (no GQA).
TINY_HRM = dict(num_hidden_layers=2, num_key_value_heads=None, head_dim=16, H_cycles=2,
                L_cycles=2)
HRM_TOKENS = 8


def test_vllm_phimoe_file_matches_transformers(registered_vllm_class, tmp_path):
    """vLLM's phimoe.py builds its LM head with a bias and loads it, but its compute_logits never
    adds it (LogitsProcessor gets no embedding_bias), so a checkpoint with a random
    `lm_head.bias` is compared in vLLM's convention: against transformers on the same checkpoint
    with that bias zeroed. Every other bias (q/k/v/o, LayerNorms) is random and must match."""
    cls = registered_vllm_class("phimoe", "PhiMoEForCausalLM", None)
    assert "._checked_phimoe_" in cls.__module__            # vLLM's class, not minivllm's own
    path = write_phimoe_checkpoint(tmp_path / "phimoe", seed=3, arch="PhiMoEForCausalLM")
    model = build_model(path)
    assert type(model) is cls
    state = load_file(os.path.join(path, "model.safetensors"))
    # Loaded (rows past the vocab are padding), never used.
    torch.testing.assert_close(model.lm_head.bias.data[:1000], state["lm_head.bias"])
    assert state["lm_head.bias"].abs().sum() > 0
    reference = tmp_path / "reference"
    shutil.copytree(path, reference)
    state["lm_head.bias"].zero_()
    save_file(state, str(reference / "model.safetensors"), metadata={"format": "pt"})
    assert_matches_transformers(path, prompts=make_prompts(1000, (5, 40)), num_tokens=12,
                                reference=str(reference))


def test_vllm_hrm_text_file_matches_transformers(registered_vllm_class, tmp_path):
    """vLLM's hrm_text.py with PrefillPrefixLMAttention: each prompt attends bidirectionally,
    generated tokens causally.

    Compared in vLLM's convention: vLLM's file makes the whole prompt the bidirectional block
    (its prefill step), while transformers' class marks that block with `token_type_ids == 1`
    and is fully causal without them; the reference passes 1 over the prompt, 0 over the
    generated tokens. Prompts 17 + 40 fill a 64-token budget to 57: the 30-token prompt waits
    a step whole (the engine schedules prefix-LM prefills whole) instead of being split."""
    cls = registered_vllm_class("hrm_text", "HrmTextForCausalLM", None)
    assert "._checked_hrm_text_" in cls.__module__
    path = write_tiny_checkpoint(tmp_path, HrmTextConfig, HrmTextForCausalLM, **TINY_HRM)
    weights_file = os.path.join(path, "model.safetensors")
    state = load_file(weights_file)
    # transformers starts the low-cycle state at zero, where a dropped one would not show.
    state["model.z_L_init"] = torch.randn(64, generator=torch.Generator().manual_seed(4))
    save_file(state, weights_file, metadata={"format": "pt"})
    assert type(build_model(path)) is cls
    prompts = make_prompts(1000, (17, 40, 30))
    reference, causal_prompt_logprobs = _hrm_prefix_lm_greedy(path, prompts)
    for budget in (512, 64):
        llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=budget,
                  max_model_len=budget)
        scheduler = llm.llm_engine.scheduler
        assert scheduler.whole_prefills and not scheduler.kv_cache_manager.enable_caching
        ours = minivllm_greedy(llm, prompts, HRM_TOKENS)
        assert_same_greedy_run(ours, reference)
    # The bidirectional prompt matters: causal attention gives other prompt logprobs.
    for (_, lp), causal, ids in zip(ours, causal_prompt_logprobs, prompts):
        assert (lp[:len(ids) - 1] - causal).abs().max() > 1e-2


@torch.inference_mode()
def _hrm_prefix_lm_greedy(path: str, prompts: list[list[int]]
                          ) -> tuple[list[tuple[list[int], torch.Tensor]], list[torch.Tensor]]:
    """transformers' greedy run with the prompt as the bidirectional block (`hf_greedy`'s
    results, full recompute each step), and each prompt's logprobs from a causal pass."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logprobs(seq: list[int], num_prompt: int | None) -> torch.Tensor:
        # [len - 1] logprob of each token after the first; None: no bidirectional block.
        types = None if num_prompt is None else torch.tensor(
            [[1] * num_prompt + [0] * (len(seq) - num_prompt)])
        logits = model(torch.tensor([seq]), token_type_ids=types, use_cache=False).logits[0]
        chosen = torch.log_softmax(logits.double(), -1)[:-1]
        return chosen.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]

    results, causal = [], []
    for ids in prompts:
        seq = list(ids)
        for _ in range(HRM_TOKENS):
            types = torch.tensor([[1] * len(ids) + [0] * (len(seq) - len(ids))])
            logits = model(torch.tensor([seq]), token_type_ids=types, use_cache=False).logits
            seq.append(int(logits[0, -1].argmax()))
        results.append((seq[len(ids):], logprobs(seq, len(ids))))
        causal.append(logprobs(list(ids), None))
    return results, causal
