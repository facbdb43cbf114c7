"""A model file written for vLLM loads through `--model-file` as it is: the import root renamed
in memory, relative imports resolved in minivllm's models package or to a sibling file."""

import textwrap

import pytest

from minivllm.entrypoints.check_model.build import load_model_file
from minivllm.entrypoints.check_model.vllm_file import imports_vllm, port_vllm_source
from tests.model_executor.layers._helpers import layer_context

VLLM_STYLE = textwrap.dedent("""\
    import torch
    import vllm.envs as envs
    from vllm import _custom_ops as ops
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.layernorm import RMSNorm
    from .utils import maybe_prefix
    from .llama import LlamaForCausalLM
    op = torch.ops.vllm.moe_forward if False else None   # an op namespace, not the root
    vllm_config_name = "vllm_config"
""")


def test_only_the_import_root_is_renamed():
    assert imports_vllm(VLLM_STYLE) and not imports_vllm("import torch\nvllm_config = 1\n")
    ported = port_vllm_source(VLLM_STYLE, lambda name: None)
    assert "import minivllm.envs as envs" in ported
    assert "from minivllm import _custom_ops as ops" in ported
    assert "from minivllm.config import VllmConfig" in ported
    assert "from minivllm.model_executor.layers.layernorm import RMSNorm" in ported
    assert "torch.ops.vllm.moe_forward" in ported and '"vllm_config"' in ported
    # minivllm has these modules: the relative imports stay relative (the file loads inside
    # minivllm's models package).
    assert "from .utils import maybe_prefix" in ported
    assert "from .llama import LlamaForCausalLM" in ported


def test_relative_import_of_a_module_minivllm_lacks_takes_the_sibling():
    asked = []

    def sibling(name: str) -> str | None:
        asked.append(name)
        return "pkg._checked_granitemoeshared_1" if name == "granitemoeshared" else None
    source = ("from .granitemoeshared import GraniteMoeSharedMLP\n"
              "from .no_such_family.sub import X\n")
    ported = port_vllm_source(source, sibling)
    assert ported.splitlines() == [
        "from pkg._checked_granitemoeshared_1 import GraniteMoeSharedMLP",
        "from .no_such_family.sub import X"]
    assert asked == ["granitemoeshared", "no_such_family"]


def test_names_minivllm_lacks_come_from_the_sibling_except_for_contract_modules():
    asked = []

    def sibling(name: str) -> str | None:
        asked.append(name)
        return f"pkg._checked_{name}_1"
    # minivllm's deepseek_v2 has DeepseekV2MLAAttention but not vLLM's non-MLA
    # DeepseekV2Attention (vLLM's glm4_moe_lite.py imports both); its utils lack `no_such`, a
    # gap the port must not paper over with vLLM's copy.
    source = textwrap.dedent("""\
        from vllm.model_executor.models.deepseek_v2 import (
            DeepseekV2Attention,
            DeepseekV2MLAAttention,
        )
        from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention as MLA
        from .utils import maybe_prefix, no_such
    """)
    lines = port_vllm_source(source, sibling).splitlines()
    assert lines[0] == "from pkg._checked_deepseek_v2_1 import ("
    assert lines[4] == ("from minivllm.model_executor.models.deepseek_v2 import "
                        "DeepseekV2MLAAttention as MLA")
    assert lines[5] == "from .utils import maybe_prefix, no_such"
    assert asked == ["deepseek_v2"]


def test_vllm_file_with_a_sibling_loads_through_model_file(tmp_path):
    (tmp_path / "tiny_base.py").write_text(textwrap.dedent("""\
        from torch import nn
        from vllm.model_executor.layers.layernorm import RMSNorm

        class TinyBase(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = RMSNorm(4)
    """))
    (tmp_path / "tiny_top.py").write_text(textwrap.dedent("""\
        from vllm.model_executor.models.utils import maybe_prefix
        from .tiny_base import TinyBase

        class TinyTop(TinyBase):
            prefix = maybe_prefix("model", "norm")
    """))
    cls = load_model_file(f"{tmp_path / 'tiny_top.py'}:TinyTop")
    assert cls.prefix == "model.norm"
    with layer_context():
        assert type(cls().norm).__module__ == "minivllm.model_executor.layers.layernorm"
    assert load_model_file(f"{tmp_path / 'tiny_top.py'}:TinyTop") is cls     # imported once
    (tmp_path / "orphan.py").write_text("from vllm.config import VllmConfig\n"
                                        "from .missing_family import Thing\n")
    with pytest.raises(ModuleNotFoundError, match="missing_family"):
        load_model_file(f"{tmp_path / 'orphan.py'}:Thing")
