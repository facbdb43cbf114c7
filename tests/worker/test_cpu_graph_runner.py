"""Decode steps replayed from CPU graphs give exactly the eager steps' tokens and logprobs."""

import pytest

from minivllm import LLM, SamplingParams
from tests.model_executor.layers.quantization._gguf_helpers import write_tiny_gguf

pytestmark = pytest.mark.requires_native

PROMPTS = ["the capital of france is", "hello world, what", "paris is the capital of france"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(str(tmp_path_factory.mktemp("graph_gguf")), "Q8_0")


def _run(path: str, mode: str, max_tokens=(9, 5, 13), **kwargs):
    llm = LLM(model=path, dtype="bfloat16", compilation_config={"cudagraph_mode": mode},
              **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
              for n in max_tokens]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                for o in outs]
    graphs = llm.llm_engine.executor.worker.model_runner.cpu_graphs
    graphs.num_preemptions = llm.llm_engine.scheduler.num_preemptions_total
    return tokens, logprobs, graphs


def test_replayed_steps_equal_eager_steps(tiny_gguf):
    tokens, logprobs, graphs = _run(tiny_gguf, "FULL_DECODE_ONLY")
    ref_tokens, ref_logprobs, ref_graphs = _run(tiny_gguf, "NONE")
    # One prefill step, then 12 decode steps: 4 of 3 sequences, 4 of 2 and 4 of 1; the first
    # step of each size captures (and runs), the other 9 replay.
    assert sorted(graphs.entries) == [1, 2, 3] and graphs.num_replays == 9
    assert not ref_graphs.enabled and not ref_graphs.entries
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs                       # the same kernels: bit for bit


def test_prefix_caching_and_preemption_keep_tokens(tiny_gguf):
    # 12 blocks of 4 slots cannot hold three growing sequences (~27 tokens each): some are
    # preempted and resume.
    kwargs = dict(block_size=4, num_gpu_blocks_override=12, enable_prefix_caching=True,
                  max_model_len=40)
    tokens, _, graphs = _run(tiny_gguf, "FULL_DECODE_ONLY", (20, 20, 20), **kwargs)
    ref_tokens, _, _ = _run(tiny_gguf, "NONE", (20, 20, 20), **kwargs)
    assert graphs.num_preemptions > 0 and graphs.num_replays > 0
    assert tokens == ref_tokens


def test_steps_with_torch_ops_stay_eager(tiny_gguf):
    # fp32 is the reference precision: its linears run dequantised tiles through torch, so the
    # capture is refused (twice, then graphs are off) and every step runs eagerly.
    llm = LLM(model=tiny_gguf, dtype="float32")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 6, 8)]
    llm.generate(PROMPTS, params, use_tqdm=False)
    graphs = llm.llm_engine.executor.worker.model_runner.cpu_graphs
    assert not graphs.entries and not graphs.enabled and graphs.num_replays == 0


def test_fused_layers_of_mixed_types_are_replayed(tmp_path):
    # llama.cpp's K-quant mixes give v_proj (and down_proj) another type than q/k: the fused
    # qkv_proj multiplies per type, each product written into its columns by a native call.
    path = write_tiny_gguf(str(tmp_path), "Q4_0", types={"v_proj.weight": "Q8_0"})
    tokens, logprobs, graphs = _run(path, "FULL_DECODE_ONLY")
    ref_tokens, ref_logprobs, _ = _run(path, "NONE")
    qkv_layers = _qkv_layers(path)
    assert qkv_layers and all("_gguf_segments" in m.__dict__ for m in qkv_layers)
    assert graphs.num_replays == 9
    assert tokens == ref_tokens and logprobs == ref_logprobs


def _qkv_layers(path: str):
    llm = LLM(model=path, dtype="bfloat16")
    model = llm.llm_engine.executor.worker.model_runner.model
    return [m for name, m in model.named_modules() if name.endswith("qkv_proj")]
