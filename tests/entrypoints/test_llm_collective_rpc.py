"""vLLM's `LLM.collective_rpc` and `LLM.apply_model`: a function (a lambda too), a Worker method
or a `worker_extension_cls` method runs on every rank, results in rank order; one rank's error
is raised to the caller and the engine keeps serving. One process, and TP=2 / PP=2 worker
processes."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("rpc_ckpt")),
                                 num_hidden_layers=2)


def _llm(checkpoint: str, **kwargs) -> LLM:
    return LLM(model=checkpoint, max_model_len=64, num_gpu_blocks_override=32, **kwargs)


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _rank_and_layers(worker, extra: int = 0, *, scale: int = 1) -> tuple[int, int]:
    model = worker.get_model()
    return worker.rank, scale * (len([m for m in model.model.layers
                                     if any(True for _ in m.parameters())]) + extra)


EXT = "tests.entrypoints._worker_ext:ParamStats"


def test_one_process(checkpoint):
    llm = _llm(checkpoint, worker_extension_cls=EXT)
    try:
        [total] = llm.collective_rpc("num_params")   # an extension method, by name
        assert total == sum(n for s in llm.apply_model(_shapes) for n in
                            (torch.Size(v).numel() for v in s.values()))
        assert llm.collective_rpc("scaled_rank", args=(3,), kwargs={"offset": 1}) == [1]
        [shapes] = llm.apply_model(_shapes)
        hidden = llm.vllm_config.model_config.hf_config.hidden_size
        assert shapes["model.embed_tokens.weight"][1] == hidden
        assert llm.collective_rpc(lambda w, k: w.rank + k, args=(5,)) == [5]
        assert llm.collective_rpc(_rank_and_layers, args=(1,), kwargs={"scale": 10}) == [(0, 30)]
        [model] = llm.collective_rpc("get_model")   # a Worker method by name
        assert model is llm.llm_engine.executor.worker.model_runner.model
    finally:
        llm.shutdown()


def _llm_stats(checkpoint: str) -> list[int]:
    llm = _llm(checkpoint, worker_extension_cls=EXT)
    try:
        return llm.collective_rpc("num_params")
    finally:
        llm.shutdown()


def test_bad_extensions_are_refused(checkpoint):
    for name, message in (("tests.entrypoints._worker_ext:Clashing", "replace Worker's execute_model"),
                          ("tests.entrypoints._worker_ext:Missing", "Cannot load"),
                          ("no_such_module_xyz.Ext", "Cannot load")):
        with pytest.raises(ValueError, match=message):
            _llm(checkpoint, worker_extension_cls=name)
        with pytest.raises(ValueError, match=message):
            _llm(checkpoint, worker_extension_cls=name, tensor_parallel_size=2)


def test_errors_name_the_problem(checkpoint):
    llm = _llm(checkpoint)
    try:
        with pytest.raises(ValueError, match="has no method 'no_such_method'"):
            llm.collective_rpc("no_such_method")
        with pytest.raises(ValueError, match="a worker method's name or a function"):
            llm.collective_rpc(42)
        with pytest.raises(ZeroDivisionError):
            llm.apply_model(lambda model: 1 / 0)
        assert len(llm.generate("The quick brown fox", GREEDY, use_tqdm=False)[0]
                   .outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


@pytest.mark.parametrize("parallel", [
    {"tensor_parallel_size": 2},
    pytest.param({"pipeline_parallel_size": 2}, marks=pytest.mark.slow)], ids=["tp2", "pp2"])
def test_every_rank_answers_in_rank_order(checkpoint, parallel):
    alone = _llm(checkpoint)
    [full] = alone.apply_model(_shapes)
    expected = list(alone.generate("The quick brown fox", GREEDY, use_tqdm=False)[0]
                    .outputs[0].token_ids)
    alone.shutdown()
    [whole] = _llm_stats(checkpoint)
    llm = _llm(checkpoint, worker_extension_cls=EXT, **parallel)
    try:
        shards = llm.apply_model(_shapes)   # a plain function and a lambda below
        assert llm.collective_rpc("scaled_rank", args=(3,)) == [0, 3]
        if "tensor_parallel_size" in parallel:   # replicated norms are counted twice
            assert sum(llm.collective_rpc("num_params")) > whole
        else:
            assert sum(llm.collective_rpc("num_params")) == whole
        assert llm.collective_rpc(lambda worker: worker.rank * 2) == [0, 2]
        if "tensor_parallel_size" in parallel:   # each rank holds half of a column-split weight
            name = "model.layers.0.mlp.gate_up_proj.weight"
            assert [s[name][0] for s in shards] == [full[name][0] // 2] * 2
        else:                                    # each stage holds its own layers
            assert llm.collective_rpc(_rank_and_layers) == [(0, 1), (1, 1)]
        with pytest.raises(ZeroDivisionError):
            llm.collective_rpc(lambda worker: 1 / worker.rank if worker.rank == 0 else 1)
        with pytest.raises(ValueError, match="has no method"):
            llm.collective_rpc("no_such_method")
        out = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == expected   # still serving after the errors
    finally:
        llm.shutdown()
