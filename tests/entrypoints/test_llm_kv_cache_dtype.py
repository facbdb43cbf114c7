"""`LLM(kv_cache_dtype=...)`: fp8 caches ("fp8" = "fp8_e4m3", "fp8_e5m2") hold twice the blocks
of a bf16 cache in the same budget, and chunked prompts that read earlier chunks back from the
fp8 cache score their tokens close to a bf16 cache (not equal: the cache really is fp8)."""

import pytest
import torch

from minivllm import LLM, SamplingParams

PROMPT = list(range(3, 90))    # 87 tokens in chunks of 16: each later chunk reads the cache


def _run(path: str, kv_cache_dtype: str) -> tuple[int, torch.dtype, torch.Tensor]:
    llm = LLM(model=path, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False,
              max_num_batched_tokens=16, enable_chunked_prefill=True, max_model_len=128)
    runner = llm.llm_engine.executor.worker.model_runner
    [cache_dtype] = {layer.kv_cache.dtype for layer in
                     runner.vllm_config.compilation_config.static_forward_context.values()
                     if hasattr(layer, "kv_cache")}
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    scores = torch.tensor([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])
    return runner.num_blocks, cache_dtype, scores


def test_fp8_caches_hold_twice_the_blocks_and_score_close(tiny_llama_factory):
    path = tiny_llama_factory()
    blocks, dtype, ref = _run(path, "auto")
    assert dtype == torch.bfloat16
    # (max differences measured: 0.10 e4m3, 0.21 e5m2, whose mantissa has one bit less)
    for name, want, bound in (("fp8", torch.float8_e4m3fn, 0.3),
                              ("fp8_e5m2", torch.float8_e5m2, 0.6)):
        fp8_blocks, fp8_dtype, scores = _run(path, name)
        assert fp8_dtype == want and fp8_blocks == 2 * blocks
        diff = (scores - ref).abs()
        assert diff[:15].max() == 0                      # the first chunk reads no cache
        assert 0 < diff.max() < bound, (name, diff.max())


def test_unknown_kv_cache_dtype_names_the_choices(tiny_llama_factory):
    with pytest.raises(ValueError, match="cache_dtype must be one of .*'fp8', 'fp8_e4m3', "
                                         "'fp8_e5m2'.*got 'int4'"):
        LLM(model=tiny_llama_factory(), kv_cache_dtype="int4")
