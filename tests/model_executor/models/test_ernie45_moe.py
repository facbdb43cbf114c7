"""ERNIE 4.5 MoE (bias-steered softmax top-k, ungated shared experts, dense layers outside the
`moe_layer_start_index` / `moe_layer_interval` grid) against transformers."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         make_prompts, write_tiny_checkpoint)

ARCH = "Ernie4_5_MoeForCausalLM"
# Layers 1 and 3 sparse (start 1, interval 2), 0 and 2 dense; 8 experts, top-2, one shared.
TINY_MOE = dict(num_hidden_layers=4, head_dim=16, moe_intermediate_size=32, moe_num_experts=8,
                moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=2)
PROMPTS = make_prompts(1000, lens=(9, 33))


def randomize(path: str, marker: str, scale: float, seed: int = 2) -> None:
    """Add noise to every checkpoint tensor whose name contains `marker` (transformers starts
    biases at zero, where a dropped or misplaced one would not show)."""
    gen = torch.Generator().manual_seed(seed)
    file = str(Path(path) / "model.safetensors")
    state = load_file(file)
    hits = [name for name in state if marker in name]
    assert hits, f"no tensor named *{marker}*"
    for name in hits:
        state[name] = state[name] + scale * torch.randn(state[name].shape, generator=gen)
    save_file(state, file, metadata={"format": "pt"})


@contextlib.contextmanager
def registered_in_workers(folder: Path, arch: str, module: str) -> Iterator[None]:
    """Worker processes (TP ranks) register minivllm's class for `arch` too, through
    check-model's temporary plugin pointed at a one-line shim that imports it."""
    from minivllm.entrypoints.check_model.build import model_file_plugin

    cls = arch
    shim = Path(folder) / f"shim_{module}.py"
    shim.write_text(f"from minivllm.model_executor.models.{module} import {cls}  # noqa: F401\n")
    with model_file_plugin(f"{shim}:{cls}", arch):
        yield


@pytest.fixture(scope="module")
def ernie45_moe_path(tmp_path_factory) -> str:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ernie45_moe"), Ernie4_5_MoeConfig,
                                 Ernie4_5_MoeForCausalLM, **TINY_MOE)
    # Softmax scores of 8 experts sit near 0.125: a bias of this size changes many choices.
    randomize(path, "e_score_correction_bias", 0.1)
    return path


def test_ernie45_moe_matches_transformers(ernie45_moe_path):
    assert_matches_transformers(ernie45_moe_path, prompts=PROMPTS, num_tokens=16)


def test_ernie45_moe_layout_and_bias(ernie45_moe_path):
    from minivllm.model_executor.models.ernie45_moe import Ernie4_5_MoeMoE

    model = build_model(ernie45_moe_path)
    assert [isinstance(layer.mlp, Ernie4_5_MoeMoE) for layer in model.model.layers] == \
        [False, True, False, True]
    assert model.num_moe_layers == 2 and model.num_routed_experts == 8
    assert model.num_shared_experts == 1
    # The [1, E] checkpoint bias is the router's [E] row.
    ckpt = load_file(str(Path(ernie45_moe_path) / "model.safetensors"))
    moe = model.model.layers[3].mlp
    expected = ckpt["model.layers.3.mlp.moe_statics.e_score_correction_bias"][0]
    assert torch.equal(moe.experts.e_score_correction_bias, expected)
    assert moe.gate.weight.dtype == torch.float32


def test_ernie45_moe_prefixes_and_bad_names(ernie45_moe_path, tmp_path):
    assert_prefixes_clean(ernie45_moe_path, ARCH)
    assert_bad_names_reported(
        ernie45_moe_path, tmp_path / "broken",
        drop=["model.layers.1.mlp.moe_statics.e_score_correction_bias",
              "model.layers.3.mlp.experts.6.down_proj.weight",
              "model.layers.1.mlp.shared_experts.up_proj.weight"],
        missing=["model.layers.1.mlp.moe_statics.e_score_correction_bias",
                 "model.layers.3.mlp.experts.w2_weight",
                 "model.layers.1.mlp.shared_experts.gate_up_proj.weight"])


def test_ernie45_moe_skips_mtp_weights(ernie45_moe_path, tmp_path):
    """ERNIE checkpoints carry a multi-token-prediction block the model does not run."""
    import shutil

    folder = tmp_path / "with_mtp"
    shutil.copytree(ernie45_moe_path, folder)
    file = str(folder / "model.safetensors")
    state = load_file(file)
    state["model.mtp_linear_proj.0.weight"] = torch.zeros(64, 128)
    state["model.mtp_block.0.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    save_file(state, file, metadata={"format": "pt"})
    build_model(str(folder))                    # loads without an unexpected-name error


@pytest.mark.slow
def test_ernie45_moe_tp2_matches_transformers(ernie45_moe_path, tmp_path):
    """TP = 2 slices every expert and the shared experts; the bias and gate stay replicated."""
    with registered_in_workers(tmp_path, ARCH, "ernie45_moe"):
        assert_matches_transformers(ernie45_moe_path, prompts=PROMPTS, num_tokens=12,
                                    tensor_parallel_size=2)
