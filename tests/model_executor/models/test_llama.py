"""Contract checks on Llama: prefixes, loaded names, and the seed's "What can go wrong" errors."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig

from minivllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from minivllm.distributed import ensure_model_parallel_initialized
from minivllm.engine.multiproc_executor import MultiprocExecutor
from minivllm.model_executor.model_loader import get_model
from minivllm.model_executor.models.prefix_check import check_prefixes
from minivllm.model_executor.models.registry import ModelRegistry
from tests.conftest import TINY_LLAMA, write_tiny_llama


def _config(path: str, **parallel) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                      parallel_config=ParallelConfig(**parallel))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("contract")))


@pytest.fixture(scope="module")
def llama(tiny_path):
    ensure_model_parallel_initialized(1, 1)
    return get_model(vllm_config=_config(tiny_path))


def test_llama_prefixes_equal_attribute_paths(llama):
    assert check_prefixes(llama) == []
    # The attention layers registered under their full paths.
    assert "model.layers.1.self_attn.attn" in llama.model.layers[1].self_attn.attn.layer_name


def test_check_prefixes_reports_a_wrong_prefix(tiny_path):
    from minivllm.model_executor.layers.linear import RowParallelLinear

    ensure_model_parallel_initialized(1, 1)
    cfg = _config(tiny_path)
    with set_current_vllm_config(cfg):
        holder = nn.Module()
        holder.proj = RowParallelLinear(8, 8, bias=False, prefix="model.wrong_name")
    found = check_prefixes(holder)
    assert [(m.path, m.prefix) for m in found] == [("proj", "model.wrong_name")]


def test_load_weights_returns_every_parameter(tiny_path):
    from minivllm.model_executor.model_loader.weight_iterators import safetensors_weights_iterator

    ensure_model_parallel_initialized(1, 1)
    cfg = _config(tiny_path)
    from minivllm.model_executor.model_loader.utils import initialize_model

    model = initialize_model(cfg)
    loaded = model.load_weights(safetensors_weights_iterator(tiny_path))
    assert {name for name, _ in model.named_parameters()} <= loaded


def test_loaded_weights_equal_checkpoint(llama, tiny_path):
    state = load_file(os.path.join(tiny_path, "model.safetensors"))
    qkv = llama.model.layers[0].self_attn.qkv_proj.weight
    q, k, v = (state[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(qkv, torch.cat([q, k, v]))
    embed = llama.model.embed_tokens.weight
    assert torch.equal(embed[:TINY_LLAMA["vocab_size"]], state["model.embed_tokens.weight"])
    assert embed[TINY_LLAMA["vocab_size"]:].abs().sum() == 0     # padding rows are zero


def test_heads_not_divisible_by_tp_lists_valid_sizes(tiny_path):
    with pytest.raises(ValueError, match=r"divisible by tensor parallel size \(3\).*\[1, 2, 4\]"):
        _config(tiny_path, tensor_parallel_size=3)


def test_kv_heads_not_divisible_lists_valid_sizes():
    hf = LlamaConfig(**{**TINY_LLAMA, "num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 3072,
                        "hidden_size": 48})
    with pytest.raises(ValueError, match=r"KV heads \(3\).*\[1, 3, 6\]"):
        VllmConfig(model_config=ModelConfig(model="dummy", hf_config=hf),
                   parallel_config=ParallelConfig(tensor_parallel_size=2))


def test_pp_larger_than_layer_count(tiny_path):
    with pytest.raises(ValueError, match="larger than the number of layers"):
        _config(tiny_path, pipeline_parallel_size=3)


def test_unsupported_activation(tmp_path):
    path = write_tiny_llama(str(tmp_path), hidden_act="gelu")
    ensure_model_parallel_initialized(1, 1)
    with pytest.raises(ValueError, match="Unsupported activation: gelu"):
        get_model(vllm_config=_config(path))


class _NoPPModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return input_ids

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def test_pp_on_model_without_supports_pp():
    ModelRegistry.register_model("ToyNoPPForCausalLM", _NoPPModel)
    hf = LlamaConfig(**TINY_LLAMA, architectures=["ToyNoPPForCausalLM"])
    cfg = VllmConfig(model_config=ModelConfig(model="dummy", hf_config=hf),
                     parallel_config=ParallelConfig(pipeline_parallel_size=2))
    # The engine's executor refuses it before any worker process starts.
    with pytest.raises(NotImplementedError, match="SupportsPP"):
        MultiprocExecutor(cfg)


def test_unknown_architecture_lists_supported(tiny_path):
    ensure_model_parallel_initialized(1, 1)
    cfg = _config(tiny_path)
    cfg.model_config.hf_config.architectures = ["FancyNewForCausalLM"]
    with pytest.raises(ValueError, match=r"FancyNewForCausalLM.*LlamaForCausalLM"):
        get_model(vllm_config=cfg)


def test_missing_and_unexpected_weights_in_one_error(tmp_path, tiny_path):
    state = load_file(os.path.join(tiny_path, "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    del state["model.norm.weight"]
    state["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    state["model.bogus.weight"] = torch.zeros(2)
    folder = tmp_path / "broken"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(tiny_path, name)):
            (folder / name).write_bytes(open(os.path.join(tiny_path, name), "rb").read())
    ensure_model_parallel_initialized(1, 1)
    with pytest.raises(ValueError) as err:
        get_model(vllm_config=_config(str(folder)))
    message = str(err.value)
    for name in ("model.layers.1.mlp.down_proj.weight", "model.norm.weight",
                 "model.layers.0.mlp.extra_proj.weight", "model.bogus.weight"):
        assert name in message
