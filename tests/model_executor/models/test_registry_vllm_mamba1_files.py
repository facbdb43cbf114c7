"""vLLM 0.33.0's own Mamba-1 files on minivllm, against transformers: mamba.py (attention-free:
every layer a MambaMixer with a per-sequence conv + SSM state; as Mamba and as Falcon-Mamba,
whose dt / B / C go through weightless RMSNorms) and jamba.py (Mamba-1 layers beside attention
layers, MoE feed-forwards every other layer), with whole prompts, prompts in chunks of 8 beside
other sequences' decodes, forced preemption, and TP=2 over real processes.

The files come from vLLM's source distribution on PyPI (see `_vllm_files`).
"""

import pytest
import torch
from transformers import (FalconMambaConfig, FalconMambaForCausalLM, JambaConfig,
                          JambaForCausalLM, MambaConfig, MambaForCausalLM)

from minivllm import LLM, SamplingParams
from minivllm.model_executor.models.interfaces import is_attention_free, is_hybrid
from tests._parallel_helpers import assert_parallel_matches_one_process
from tests.model_executor.models._family_helpers import (assert_matches_transformers,
                                                         assert_preemption_keeps_tokens,
                                                         build_model, write_tiny_checkpoint)
from tests.model_executor.models._family_helpers import STATE_BUDGETS

# An inner width of 128, 16 state entries, dt rank 8. max_position_embeddings (not a Mamba
# config field, kept in config.json) bounds max_model_len.
TINY_MAMBA = dict(hidden_size=64, state_size=16, expand=2, conv_kernel=4, num_hidden_layers=2,
                  time_step_rank=8, max_position_embeddings=512)

# Layers: mamba + MLP, attention + MoE, mamba + MLP, attention + MoE.
TINY_JAMBA = dict(hidden_size=64, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                  num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                  mamba_dt_rank=8, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=512)

FILES = {"mamba": ("mamba", MambaConfig, MambaForCausalLM, TINY_MAMBA),
         "falcon_mamba": ("mamba", FalconMambaConfig, FalconMambaForCausalLM, TINY_MAMBA),
         "jamba": ("jamba", JambaConfig, JambaForCausalLM, TINY_JAMBA)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return {name: write_tiny_checkpoint(tmp_path_factory.mktemp(name), config_cls, model_cls,
                                        **overrides)
            for name, (_, config_cls, model_cls, overrides) in FILES.items()}


def _register(registered_vllm_class, name: str) -> type:
    file, _, model_cls, _ = FILES[name]
    # mamba.py's one class serves both Mamba and Falcon-Mamba checkpoints, as in vLLM.
    return registered_vllm_class(file, model_cls.__name__,
                                 "MambaForCausalLM" if file == "mamba" else None)


@STATE_BUDGETS
@pytest.mark.parametrize("name", list(FILES))
def test_vllm_mamba1_file_matches_transformers(paths, registered_vllm_class, name, budget):
    cls = _register(registered_vllm_class, name)
    model = build_model(paths[name])
    assert type(model) is cls and f"._checked_{FILES[name][0]}_" in cls.__module__
    assert (is_hybrid(model), is_attention_free(model)) == ((True, False) if name == "jamba"
                                                            else (False, True))
    assert_matches_transformers(paths[name], max_num_batched_tokens=budget)


@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_vllm_mamba1_preempted_sequences_restart_their_state(paths, registered_vllm_class,
                                                             name):
    _register(registered_vllm_class, name)
    assert_preemption_keeps_tokens(paths[name])


@pytest.mark.parametrize("name", ["mamba", pytest.param("jamba", marks=pytest.mark.slow)])
def test_vllm_mamba1_file_at_tp2_equals_one_process(paths, registered_vllm_class, name):
    """Channels split over two ranks: x_proj (row-parallel) all-reduces dt / B / C."""
    from minivllm.entrypoints.check_model.build import model_file_plugin
    from tests.model_executor.models._vllm_files import vllm_models_dir

    file, _, model_cls, _ = FILES[name]
    cls_name = "MambaForCausalLM" if file == "mamba" else model_cls.__name__
    _register(registered_vllm_class, name)
    with model_file_plugin(f"{vllm_models_dir() / file}.py:{cls_name}", model_cls.__name__):
        assert_parallel_matches_one_process(paths[name], tensor_parallel_size=2)


def test_vllm_mamba1_state_dtypes(paths, registered_vllm_class):
    """bf16 weights with an fp32 SSM state keep the dtypes asked for and generate."""
    _register(registered_vllm_class, "mamba")
    llm = LLM(model=paths["mamba"], dtype="bfloat16", mamba_ssm_cache_dtype="float32",
              block_size=4, num_gpu_blocks_override=64, max_model_len=128)
    mixer = llm.llm_engine.executor.worker.model_runner.model.backbone.layers[0].mixer
    assert (mixer.conv_state.dtype, mixer.ssm_state.dtype) == (torch.bfloat16, torch.float32)
    assert mixer.ssm_state.shape[1:] == (128, 16)
    out = llm.generate([[5, 17, 300, 42]], SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
