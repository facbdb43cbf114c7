"""Weights loaded into a running engine (vLLM's RLHF pattern): pushed with
`model.load_weights` (whole, or a tensor per call as vLLM's example does) or read by the
worker's `reload_weights`, the engine answers exactly as a fresh engine on those weights (bf16:
the prompt-sized GEMMs' packed copies are rebuilt); quantized models refuse clearly."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model_executor.model_loader.weight_iterators import safetensors_weights_iterator
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

# Prompts past the native GEMV's 8 rows: their GEMMs use the packed copy of each bf16 weight.
PROMPTS = ["the quick brown fox jumps over the lazy dog and the cat", "Hello world hello world"]
PARAMS = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_updates")
    return (write_tiny_checkpoint(str(root / "a"), seed=0),
            write_tiny_checkpoint(str(root / "b"), seed=1))


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, dtype="bfloat16", max_model_len=128, num_gpu_blocks_override=32,
               enable_prefix_caching=False, **kwargs)


def _answers(llm: LLM) -> list[tuple[list[int], list[float]]]:
    out = []
    for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False):
        prompt_lps = [next(iter(lp.values())).logprob for lp in o.prompt_logprobs[1:]]
        out.append((list(o.outputs[0].token_ids), prompt_lps))
    return out


@pytest.fixture(scope="module")
def expected(checkpoints):
    return [_answers(_llm(path)) for path in checkpoints]


@pytest.mark.parametrize("per_tensor", [False, True])
def test_pushed_weights_answer_like_a_fresh_engine(checkpoints, expected, per_tensor):
    llm = _llm(checkpoints[0])
    assert _answers(llm) == expected[0]
    weights = list(safetensors_weights_iterator(checkpoints[1]))

    def push(model: torch.nn.Module) -> None:
        if per_tensor:     # vLLM's RLHF example: one call per broadcast tensor
            for name, tensor in weights:
                model.load_weights([(name, tensor)])
        else:
            model.load_weights(weights)

    llm.apply_model(push)
    assert _answers(llm) == expected[1]


def test_reload_weights_from_a_folder_and_back(checkpoints, expected):
    llm = _llm(checkpoints[0])
    llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoints[1]})
    assert _answers(llm) == expected[1]
    llm.collective_rpc("reload_weights")              # the engine's own checkpoint again
    assert _answers(llm) == expected[0]
    with pytest.raises(ValueError, match="not one"):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": "/no/such/folder"})


def test_quantized_models_refuse_weight_updates(checkpoints):
    llm = LLM(model=checkpoints[0], dtype="bfloat16", max_model_len=64, quantization="fp8",
              num_gpu_blocks_override=16)
    before = _answers(llm)
    with pytest.raises(ValueError, match=r"Fp8LinearMethod \(model\.layers\.0\.[a-z_.]+\).*"
                                         "derive their tensors"):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoints[1]})
    assert _answers(llm) == before                       # nothing was written


@pytest.mark.slow
def test_worker_processes_reload_their_shards(checkpoints, expected):
    llm = _llm(checkpoints[0], tensor_parallel_size=2)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoints[1]})
    tp1 = _answers(_llm(checkpoints[1]))
    assert [t for t, _ in _answers(llm)] == [t for t, _ in tp1]
    llm.shutdown()
