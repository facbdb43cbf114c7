"""vLLM's engine flags a copied command line brings: --hf-overrides, --trust-remote-code,
--tokenizer-mode, --skip-tokenizer-init, --gpu-memory-utilization and
--distributed-executor-backend, each doing what vLLM's does (or refused naming the choices)."""

import argparse
import json
import os

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.worker.kv_budget import default_kv_bytes
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("flags")))


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
               **kwargs)


def test_hf_overrides_reach_the_model(checkpoint):
    """A dict (CLI: JSON) or a function laid over the HF config: the layers are built with it."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", checkpoint, "--hf-overrides",
                              '{"rms_norm_eps": 0.25, "max_position_embeddings": 48}'])
    config = EngineArgs.from_cli_args(args).create_engine_config().model_config
    assert config.hf_config.rms_norm_eps == 0.25 and config.max_model_len == 48

    def halve_eps(hf_config):
        hf_config.rms_norm_eps = 0.125
        return hf_config

    llm = LLM(model=checkpoint, dtype="float32", max_model_len=32, hf_overrides=halve_eps,
              num_gpu_blocks_override=8)
    eps = llm.apply_model(lambda model: model.model.norm.variance_epsilon)
    assert eps == [0.125]


def test_trust_remote_code_runs_the_folders_config_code(checkpoint, tmp_path):
    """A config class shipped in the folder (`auto_map`) loads only when trusted."""
    import shutil

    folder = shutil.copytree(checkpoint, tmp_path / "custom")
    with open(folder / "configuration_tiny.py", "w") as f:
        f.write("from transformers import LlamaConfig\n\n\n"
                "class TinyConfig(LlamaConfig):\n    model_type = 'tiny_custom'\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny_custom",
                  auto_map={"AutoConfig": "configuration_tiny.TinyConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        _llm(str(folder))
    trusted = _llm(str(folder), trust_remote_code=True)
    assert type(trusted.llm_engine.vllm_config.model_config.hf_config).__name__ == "TinyConfig"
    reference = _llm(checkpoint)
    prompt = ["the quick brown fox"]
    assert [o.outputs[0].token_ids for o in trusted.generate(prompt, GREEDY, use_tqdm=False)] \
        == [o.outputs[0].token_ids for o in reference.generate(prompt, GREEDY, use_tqdm=False)]


def test_tokenizer_modes_and_skipping_the_tokenizer(checkpoint):
    slow = _llm(checkpoint, tokenizer_mode="slow").get_tokenizer()
    assert slow("hello world").input_ids == _llm(checkpoint).get_tokenizer()(
        "hello world").input_ids
    with pytest.raises(ValueError, match="minivllm runs auto, hf, slow"):
        _llm(checkpoint, tokenizer_mode="mistral")
    bare = _llm(checkpoint, skip_tokenizer_init=True)
    assert bare.get_tokenizer() is None
    (out,) = bare.generate([{"prompt_token_ids": [5, 6, 7, 8]}], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate(["a text prompt"], GREEDY, use_tqdm=False)


def test_gpu_memory_utilization(checkpoint, monkeypatch):
    """CPU budgets ignore it (as vLLM's CPU backend); on CUDA the cache gets the share of the
    GPU's memory that what is already held leaves."""
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        _llm(checkpoint, gpu_memory_utilization=1.5)
    assert default_kv_bytes(torch.device("cpu"), 0.1) == default_kv_bytes(torch.device("cpu"))
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 40 * gib))
    assert default_kv_bytes(torch.device("cuda"), 0.5) == 10 * gib    # 20 GiB allowed, 10 held
    with pytest.raises(ValueError, match="No GPU memory left for the KV cache"):
        default_kv_bytes(torch.device("cuda"), 0.2)


def test_distributed_executor_backend(checkpoint):
    with pytest.raises(ValueError, match="'ray' is not supported; choose one of mp, uni"):
        _llm(checkpoint, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        _llm(checkpoint, distributed_executor_backend="uni", tensor_parallel_size=2)
    in_process = _llm(checkpoint, distributed_executor_backend="uni")
    worker_process = _llm(checkpoint, distributed_executor_backend="mp")
    assert type(worker_process.llm_engine.executor).__name__ == "MultiprocExecutor"
    assert worker_process.collective_rpc(lambda worker: os.getpid()) != [os.getpid()]
    prompt = ["hello world"]
    assert [o.outputs[0].token_ids for o in worker_process.generate(prompt, GREEDY,
                                                                    use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in in_process.generate(prompt, GREEDY, use_tqdm=False)]
    worker_process.shutdown()
