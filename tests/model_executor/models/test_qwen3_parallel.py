"""TP=2 and PP=2 over real gloo worker processes equal TP=1 for Qwen3 (QK-norm, tied head on the
last PP stage) and TP=2 for Gemma 3 (GemmaAttention's head split, windows, per-type RoPE)."""

import pytest
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

from minivllm import LLM
from tests._parallel_helpers import TINY, engine_kwargs, greedy_run, live_children, prompts
from tests.model_executor.models._family_helpers import write_tiny_checkpoint

FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16, tie_word_embeddings=True)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2)),
}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """`run(name) -> (path, the TP=1 greedy run)`, made once per family."""
    cache: dict[str, tuple[str, tuple]] = {}

    def run(name: str) -> tuple[str, tuple]:
        if name not in cache:
            config_cls, model_cls, extra = FAMILIES[name]
            path = write_tiny_checkpoint(tmp_path_factory.mktemp(name), config_cls, model_cls,
                                         **{**TINY, **extra})
            cache[name] = (path, greedy_run(LLM(model=path, **engine_kwargs()), prompts()))
        return cache[name]

    return run


@pytest.mark.parametrize("name, tp, pp", [
    ("qwen3", 2, 1), ("qwen3", 1, 2),
    pytest.param("gemma3", 2, 1, marks=pytest.mark.slow),   # ~20 s more
], ids=["qwen3_tp2", "qwen3_pp2", "gemma3_tp2"])
def test_parallel_matches_single_process(single_process, name, tp, pp):
    path, (ref_tokens, ref_logprobs) = single_process(name)
    llm = LLM(model=path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **engine_kwargs())
    assert len(live_children()) == tp * pp
    tokens, logprobs = greedy_run(llm, prompts())
    llm.shutdown()
    assert tokens == ref_tokens
    assert (logprobs - ref_logprobs).abs().max().item() <= 1e-4
