"""vLLM 0.33.0's own Mamba-2 files on minivllm, against transformers: mamba2.py (attention-free:
every layer a MambaMixer2 with a per-sequence conv + SSM state) with whole prompts, prompts in
chunks beside other sequences' decodes, forced preemption, and TP=2 over real processes with
one SSM group (copied to every rank) and with two (split); granitemoehybrid.py (Mamba-2 layers
beside attention layers, MoE MLPs with a shared expert) and falcon_h1.py (attention and Mamba-2
side by side in every layer, muP multipliers on every branch), whole and chunked.

The files come from vLLM's source distribution on PyPI (see `_vllm_files`).
"""

import pytest
import torch
from transformers import (FalconH1Config, FalconH1ForCausalLM, GraniteMoeHybridConfig,
                          GraniteMoeHybridForCausalLM, Mamba2Config, Mamba2ForCausalLM)

from minivllm import LLM
from tests._parallel_helpers import assert_parallel_matches_one_process
from tests.model_executor.models._family_helpers import (assert_matches_transformers,
                                                         assert_preemption_keeps_tokens,
                                                         build_model, write_tiny_checkpoint)
from tests.model_executor.models._family_helpers import STATE_BUDGETS

# 8 heads of 16 over an inner width of 128; chunk_size 16 so transformers' own scan chunks too.
# max_position_embeddings (not a Mamba2Config field, kept in config.json) bounds max_model_len.
TINY_MAMBA2 = dict(hidden_size=64, num_heads=8, head_dim=16, expand=2, state_size=16,
                   conv_kernel=4, num_hidden_layers=2, layer_norm_epsilon=1e-5, chunk_size=16,
                   rms_norm_eps=None, intermediate_size=None, num_attention_heads=None,
                   num_key_value_heads=None, max_position_embeddings=512)

TINY_GRANITE_HYBRID = dict(layer_types=["mamba", "attention", "mamba"], num_hidden_layers=3,
                           mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_n_groups=1,
                           mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
                           num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                           shared_intermediate_size=64, position_embedding_type="rope")

# Every multiplier away from 1, so a dropped or misplaced one shows (the SSM ones scale
# in_proj's z / x / B / C / dt blocks through MambaMixer2's mup_vector).
TINY_FALCON_H1 = dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                      mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
                      head_dim=16, lm_head_multiplier=0.7, embedding_multiplier=1.3,
                      mlp_multipliers=[0.9, 1.1], key_multiplier=0.8,
                      attention_out_multiplier=1.2, attention_in_multiplier=0.9,
                      ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], ssm_in_multiplier=1.1,
                      ssm_out_multiplier=0.9)


@pytest.fixture(scope="module")
def mamba2_paths(tmp_path_factory) -> dict[int, str]:
    return {groups: write_tiny_checkpoint(tmp_path_factory.mktemp(f"mamba2_g{groups}"),
                                          Mamba2Config, Mamba2ForCausalLM, n_groups=groups,
                                          **TINY_MAMBA2)
            for groups in (1, 2)}


@pytest.mark.parametrize("groups", [1, 2])
@STATE_BUDGETS
def test_vllm_mamba2_file_matches_transformers(mamba2_paths, registered_vllm_class, groups,
                                               budget):
    cls = registered_vllm_class("mamba2", "Mamba2ForCausalLM", None)
    model = build_model(mamba2_paths[groups])
    assert type(model) is cls and "._checked_mamba2_" in cls.__module__
    assert_matches_transformers(mamba2_paths[groups], max_num_batched_tokens=budget)


def test_vllm_mamba2_preempted_sequences_restart_their_state(mamba2_paths,
                                                             registered_vllm_class):
    registered_vllm_class("mamba2", "Mamba2ForCausalLM", None)
    assert_preemption_keeps_tokens(mamba2_paths[2])


@pytest.mark.parametrize("groups", [1, 2], ids=["one_group_copied", "two_groups_split"])
def test_vllm_mamba2_file_at_tp2_equals_one_process(mamba2_paths, registered_vllm_class,
                                                    groups):
    from minivllm.entrypoints.check_model.build import model_file_plugin
    from tests.model_executor.models._vllm_files import vllm_models_dir

    registered_vllm_class("mamba2", "Mamba2ForCausalLM", None)
    # The worker processes register vLLM's class through a general plugin, as a user would.
    with model_file_plugin(f"{vllm_models_dir() / 'mamba2'}.py:Mamba2ForCausalLM",
                           "Mamba2ForCausalLM"):
        assert_parallel_matches_one_process(mamba2_paths[groups], tensor_parallel_size=2)


def test_check_model_passes_on_vllm_mamba2_file_at_tp2(mamba2_paths):
    """`minivllm check-model --model-file <vLLM>/mamba2.py:Mamba2ForCausalLM --hf -tp 2`."""
    from minivllm.entrypoints.check_model import CheckOptions, run_checks
    from tests.model_executor.models._vllm_files import vllm_models_dir

    spec = f"{vllm_models_dir() / 'mamba2'}.py:Mamba2ForCausalLM"
    report = run_checks(CheckOptions(mamba2_paths[1], hf=True, model_file=spec,
                                     tensor_parallel_size=2))
    assert {s.status for s in report.sections.values()} == {"pass"}, report.to_text()


HYBRID_FILES = {"granitemoehybrid": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM,
                                     TINY_GRANITE_HYBRID),
                "falcon_h1": (FalconH1Config, FalconH1ForCausalLM, TINY_FALCON_H1)}


@STATE_BUDGETS
@pytest.mark.parametrize("file", list(HYBRID_FILES))
def test_vllm_hybrid_mamba2_file_matches_transformers(registered_vllm_class, tmp_path, file,
                                                      budget):
    config_cls, model_cls, overrides = HYBRID_FILES[file]
    cls = registered_vllm_class(file, model_cls.__name__, None)
    path = write_tiny_checkpoint(tmp_path, config_cls, model_cls, **overrides)
    model = build_model(path)
    assert type(model) is cls and model.is_hybrid
    assert_matches_transformers(path, max_num_batched_tokens=budget)


def test_vllm_mamba2_state_dtypes(mamba2_paths, registered_vllm_class):
    """bf16 weights with an fp32 SSM state (`--mamba-ssm-cache-dtype float32`) run and keep
    the dtypes asked for; an unknown state dtype is refused with the valid ones."""
    from minivllm import SamplingParams

    registered_vllm_class("mamba2", "Mamba2ForCausalLM", None)
    llm = LLM(model=mamba2_paths[2], dtype="bfloat16", mamba_ssm_cache_dtype="float32",
              block_size=4, num_gpu_blocks_override=64, max_model_len=128)
    mixer = llm.llm_engine.executor.worker.model_runner.model.backbone.layers[0].mixer
    assert (mixer.conv_state.dtype, mixer.ssm_state.dtype) == (torch.bfloat16, torch.float32)
    out = llm.generate([[5, 17, 300, 42]], SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of"):
        LLM(model=mamba2_paths[2], mamba_ssm_cache_dtype="int3")
