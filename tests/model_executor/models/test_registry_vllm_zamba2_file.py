"""vLLM 0.33.0's zamba2.py on minivllm, against transformers' Zamba2: Mamba-2 layers alone, and
Mamba-2 layers beside hybrid ones (a shared transformer block fed the layer's input concatenated
with the original embeddings, two of them used in turn, per-layer LoRA adapters on the shared
block, RoPE in it), with whole prompts and with prompts in chunks of 8 beside other sequences'
decodes.

Two conventions differ between the two implementations:
- vLLM's Zamba2 always ties the LM head to the embedding (as Zyphra's checkpoints do): on an
  untied checkpoint it ignores `lm_head.weight` and the tokens differ even with Mamba layers
  alone. The checkpoints are written tied.
- transformers' Zamba2 clamps each step size from below at `time_step_min` (1e-3) after the
  softplus; vLLM's runs `MambaMixer2`, which (as the mamba_ssm kernels' default dt_limit
  (0, inf)) does not. Random weights give steps below 1e-3: on the hybrid checkpoint with the
  suite's four prompts and 24 tokens, logprobs drifted 5e-5 to 1.04e-4 apart; without the clamp
  they agree to 2e-6, as closely as transformers' fp32 run agrees with its own fp64 one. The
  reference runs the same weights with `time_step_min` 1e-30, which disables the clamp and
  nothing else: the field otherwise only seeds the initialisation of `dt_bias`, which the
  checkpoint holds (0 would break that initialisation's log).
"""

import json
import shutil

import pytest
import transformers

from minivllm import LLM
from tests.model_executor.models._family_helpers import (build_model, hf_greedy, make_prompts,
                                                         minivllm_greedy, write_tiny_checkpoint)
from tests.model_executor.models.test_registry_vllm_more_files import assert_same_greedy_run

# 8 Mamba heads of 16 over an inner width of 128; chunk_size 16 so transformers' scan chunks.
_TINY_ZAMBA2 = dict(mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
                    n_mamba_heads=8, chunk_size=16, num_attention_heads=4,
                    num_key_value_heads=None, use_mem_eff_path=False, use_mamba_kernels=False,
                    tie_word_embeddings=True)
VARIANTS = {
    "mamba_only": dict(num_hidden_layers=2, layers_block_type=["mamba", "mamba"]),
    "hybrid_shared_blocks": dict(num_hidden_layers=4,
                                 layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                                 num_mem_blocks=2, use_shared_attention_adapter=True,
                                 adapter_rank=8, use_mem_rope=True),
}


@pytest.fixture(scope="module")
def zamba2_paths(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """{variant: (checkpoint, the same weights with transformers' step clamp disabled)}"""
    paths = {}
    for name, overrides in VARIANTS.items():
        path = write_tiny_checkpoint(tmp_path_factory.mktemp(f"zamba2_{name}"),
                                     transformers.Zamba2Config,
                                     transformers.Zamba2ForCausalLM, **_TINY_ZAMBA2,
                                     **overrides)
        reference = tmp_path_factory.mktemp(f"zamba2_{name}_reference")
        shutil.copytree(path, reference, dirs_exist_ok=True)
        config = json.loads((reference / "config.json").read_text())
        (reference / "config.json").write_text(json.dumps({**config, "time_step_min": 1e-30}))
        paths[name] = (path, str(reference))
    return paths


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_vllm_zamba2_file_matches_transformers(zamba2_paths, registered_vllm_class, variant):
    """Whole prompts, then prompts in chunks of 8, against one transformers run."""
    cls = registered_vllm_class("zamba2", "Zamba2ForCausalLM", None)
    path, reference_path = zamba2_paths[variant]
    assert type(build_model(path)) is cls and "._checked_zamba2_" in cls.__module__
    prompts = make_prompts(1000, (5, 17, 40))
    reference = hf_greedy(reference_path, prompts, 16)
    for budget in (512, 8):
        llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=budget)
        assert_same_greedy_run(minivllm_greedy(llm, prompts, 16), reference)
