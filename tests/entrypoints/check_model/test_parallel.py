"""parallel section: valid TP sizes, the PP split (VLLM_PP_LAYER_PARTITION), a real dry run."""

import pytest

from minivllm.entrypoints.check_model import CheckOptions, run_checks
from minivllm.entrypoints.check_model.build import make_target
from minivllm.entrypoints.check_model.parallel import parallel_section
from minivllm.entrypoints.check_model.report import Section


def _section(path: str, tp: int = 1, pp: int = 1, dry_run: bool = False, **target) -> Section:
    section = Section("parallel")
    parallel_section(section, make_target(path, **target), tp, pp, dry_run=dry_run)
    return section


def test_valid_tp_sizes_and_shapes(tiny_llama_factory):
    # 4 heads, 2 KV heads (replicated at TP 4), vocab 1000 padded to 1024, intermediate 128
    section = _section(tiny_llama_factory())
    assert section.data["valid_tp_sizes"] == [1, 2, 4]
    assert section.data["tp_shapes"][4] == {"heads_per_rank": 1, "kv_heads_per_rank": 1,
                                            "kv_heads_replicated": True,
                                            "vocab_rows_per_rank": 256}
    assert section.status == "pass"


def test_invalid_tp_size_fails_listing_the_valid_ones(tiny_llama_factory):
    [error] = _section(tiny_llama_factory(), tp=3).errors()
    assert error.check == "tp_size" and "valid sizes: [1, 2, 4]" in error.message


def test_pp_partition_honours_the_environment(tiny_llama_factory, monkeypatch):
    path = tiny_llama_factory("four_layers", num_hidden_layers=4)
    assert _section(path).data["pp_layer_partition"][2] == [[0, 2], [2, 4]]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    section = _section(path, pp=2)
    assert section.data["pp_layer_partition"][2] == [[0, 1], [1, 4]]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,1,2")
    assert _section(path, pp=2).errors()[0].check == "pp_partition"


_RANK_MARKER = """
from minivllm.distributed import get_tensor_model_parallel_world_size
from minivllm.model_executor.models.llama import LlamaForCausalLM as _Base


class MarkedLlama(_Base):
    def __init__(self, *, vllm_config, prefix=""):
        if get_tensor_model_parallel_world_size() > 1:
            raise RuntimeError("the --model-file class was built in a worker rank")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
"""


@pytest.mark.slow
def test_model_file_reaches_every_rank_through_a_temporary_plugin(tiny_llama_factory, tmp_path):
    import os

    (tmp_path / "marked.py").write_text(_RANK_MARKER)
    before = os.environ.get("PYTHONPATH")
    section = _section(tiny_llama_factory(), tp=2, dry_run=True,
                       model_file=f"{tmp_path / 'marked.py'}:MarkedLlama")
    [error] = section.errors()
    assert error.check == "dry_run" and "built in a worker rank" in error.message
    assert os.environ.get("PYTHONPATH") == before


@pytest.mark.slow
def test_tp2_dry_run_builds_and_loads_every_rank(tiny_llama_factory):
    report = run_checks(CheckOptions(tiny_llama_factory(), tensor_parallel_size=2))
    parallel = report.sections["parallel"]
    assert parallel.status == "pass", parallel.findings
    assert parallel.data["dry_run"]["ranks"] == 2


def test_pp_needs_support_and_enough_layers(tiny_llama_factory, tmp_path):
    (tmp_path / "no_pp.py").write_text(
        "from torch import nn\n\n\nclass NoPP(nn.Module):\n"
        "    def __init__(self, *, vllm_config, prefix=''):\n        super().__init__()\n")
    no_pp = _section(tiny_llama_factory(), pp=2, model_file=f"{tmp_path / 'no_pp.py'}:NoPP")
    assert [e.check for e in no_pp.errors()] == ["pp_support"]
    assert [e.check for e in _section(tiny_llama_factory(), pp=3).errors()] == ["pp_size"]


def test_gguf_blocks_and_moe_experts_limit_tp(tmp_path):
    """A packed MoE GGUF: the experts' intermediate size (32, one Q8_0 block) cannot be split,
    the row-parallel o_proj (64 inputs) only in halves; the report names the layer that refuses
    and the loaded model's limits, while the config alone would allow 1, 2 and 4."""
    from tests.model_executor.model_loader.test_gguf_loader_moe import write_moe_gguf

    path, _ = write_moe_gguf(str(tmp_path), "qwen2_moe")
    assert _section(path).data["valid_tp_sizes"] == [1, 2, 4]       # no model: config only
    report = run_checks(CheckOptions(path, tensor_parallel_size=2))
    parallel = report.sections["parallel"]
    assert parallel.data["valid_tp_sizes"] == [1]
    assert any(limit.startswith("model.layers.0.self_attn.o_proj (input 64, 32-value GGUF")
               for limit in parallel.data["layer_limits"])
    [error] = parallel.errors()
    assert error.check == "tp_size"
    assert ("refused by model.layers.0.mlp.experts (MoE intermediate 32, 32-value GGUF "
            "blocks)") in error.message and "valid sizes: [1]" in error.message


def test_unquantized_moe_limits_tp_by_its_intermediate_size(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.model_executor.models._family_helpers import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                                 moe_intermediate_size=18, num_experts=4, num_experts_per_tok=2,
                                 head_dim=32)
    report = run_checks(CheckOptions(path))
    parallel = report.sections["parallel"]
    # 4 heads, 2 KV heads, intermediate 128: 1, 2, 4; the experts' 18 rules out 4
    assert parallel.data["valid_tp_sizes"] == [1, 2]
    assert parallel.data["layer_limits"] == ["model.layers.0.mlp.experts (MoE intermediate 18)"]
