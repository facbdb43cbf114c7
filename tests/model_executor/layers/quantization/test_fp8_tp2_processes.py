"""An fp8 checkpoint (per-shard scales, static input scales, an ignored layer) over TP=2 worker
processes equals TP=1.

NOTE: static input scales, because with dynamic ones TP=2 legitimately differs: a row-parallel
rank scales its own slice of the activations (as in vLLM), so the e4m3 rounding changes."""

import pytest
import torch

from minivllm import LLM
from tests._parallel_helpers import TINY, greedy_run, prompts
from tests.model_executor.layers.quantization import _checkpoints as ck

SKIPPED = "model.layers.1.mlp.down_proj"
CONFIG = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": [SKIPPED]}
# bf16: TP=2 sums the row-parallel partial products in another order (one bf16 rounding more),
# and now and then that moves an activation across an e4m3 rounding edge of the next layer: the
# W8A8 bound of test_fp8.py (measured here: 0.14; a mis-sharded weight or scale costs nats).
ATOL = 0.35


@pytest.mark.slow   # ~45 s: two engines, one of them with two worker processes
def test_fp8_tp2_matches_tp1(tiny_llama_factory, tmp_path):
    src = tiny_llama_factory("dist_tiny", **TINY)
    def quantize(name: str, w: torch.Tensor):
        tensors, deq = ck.fp8_per_tensor(name, w)
        return {**tensors, "input_scale": torch.tensor(8.0 / 448)}, deq

    path = ck.write_quantized(src, str(tmp_path / "fp8"), quantize, CONFIG, skip=(SKIPPED,))
    kwargs = dict(dtype="bfloat16", block_size=4, max_num_batched_tokens=32,
                  num_gpu_blocks_override=256)
    ref_tokens, ref_lp = greedy_run(LLM(model=path, **kwargs), prompts(), num_tokens=4)
    llm = LLM(model=path, tensor_parallel_size=2, **kwargs)
    tokens, lp = greedy_run(llm, prompts(), num_tokens=4)
    diff = (lp - ref_lp).abs()
    # greedy tokens may only part at a bf16 near-tie; all logprobs up to there agree
    assert tokens == ref_tokens or diff.max().item() <= ATOL
    assert diff[: sum(n - 1 for n in (5, 19, 42))].max().item() <= ATOL   # the prompt logprobs
