"""DeepSeek-V2 / V3 (multi-head latent attention on a latent-row KV cache; fine-grained MoE with
shared experts, grouped / biased routing) against transformers, and the same over TP=2."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                          DeepseekV3ForCausalLM, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM)

from minivllm import LLM, SamplingParams
from tests._parallel_helpers import assert_parallel_matches_one_process
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         make_prompts, write_tiny_checkpoint)

# Head dims that differ from each other (Dn 16, R 8, Dv 12) so a swapped split would show.
TINY_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                num_key_value_heads=4, head_dim=None, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
        "rope_theta": 10000.0}


def _v2_without_q_lora(**fields) -> DeepseekV2Config:
    # V2-Lite's shape: queries straight from the hidden state (write_tiny_checkpoint drops
    # None overrides, so the field is set here).
    return DeepseekV2Config(**fields, q_lora_rank=None)


VARIANTS = {
    # V2-Lite: no query LoRA, greedy softmax routing, shared expert.
    "v2_lite": (_v2_without_q_lora, DeepseekV2ForCausalLM, {}),
    # V2: query LoRA (the fused q_a / kv_a projection), top-k inside the best 2 of 4 groups.
    "v2_grouped": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5)),
    # V3: sigmoid scores with the correction bias, renormalised, scaled; YaRN with mscale.
    "v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_parameters=YARN)),
    # GLM-4.7-Flash: V3's routing (its config names neither method nor scoring), Dv != Dn.
    "glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, dict(
        q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=1.8,
        norm_topk_prob=True)),
}


def _randomise_correction_bias(path: str) -> None:
    """The V3 correction bias starts at 0: give it values that change the expert choice."""
    file = f"{path}/model.safetensors"
    state = load_file(file)
    gen = torch.Generator().manual_seed(5)
    state["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.randn(8, generator=gen)
    save_file(state, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for name, (config_cls, model_cls, extra) in VARIANTS.items():
        paths[name] = write_tiny_checkpoint(tmp_path_factory.mktemp(f"deepseek_{name}"),
                                            config_cls, model_cls, **TINY_MLA, **extra)
    for name in ("v3", "glm4_moe_lite"):
        _randomise_correction_bias(paths[name])
    return paths


# glm4_moe_lite's MLA file is also checked by test_registry_vllm_mla_files (default suite).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "glm4_moe_lite"
                                  else n for n in VARIANTS])
def test_deepseek_matches_transformers(checkpoints, name):
    assert_matches_transformers(checkpoints[name])


def test_deepseek_chunked_prefill_and_prefix_cache(checkpoints):
    # 8-token chunks over 4-token blocks: prompt chunks attend to cached latent rows (gathered
    # from the cache and decompressed), and a repeated prompt starts from cached blocks.
    path = checkpoints["v2_grouped"]
    lens = (5, 17, 33, 33)
    batch = make_prompts(1000, lens)
    batch[3] = batch[2][:20] + batch[3][20:]                    # shares 20 tokens with prompt 2
    assert_matches_transformers(path, prompts=batch, max_num_batched_tokens=8,
                                enable_prefix_caching=True)


def test_deepseek_latent_cache_and_prefixes(checkpoints, tmp_path):
    from minivllm.model_executor.layers.attention.mla_attention import MLAAttention

    path = checkpoints["v3"]
    model = build_model(path)
    assert_prefixes_clean(path, "DeepseekV3ForCausalLM")
    mla = [m for m in model.modules() if isinstance(m, MLAAttention)]
    assert len(mla) == 2
    # One latent row (kv_lora_rank + qk_rope_head_dim) per token and layer, not per head.
    assert mla[0].get_kv_cache_shape(10, 4) == (10, 4, 32 + 8)
    assert_bad_names_reported(
        path, tmp_path / "broken",
        drop=["model.layers.1.mlp.gate.e_score_correction_bias",
              "model.layers.0.self_attn.kv_b_proj.weight"])


def test_deepseek_unsupported_topk_method(tmp_path):
    path = write_tiny_checkpoint(tmp_path, DeepseekV2Config, DeepseekV2ForCausalLM, **TINY_MLA,
                                 q_lora_rank=24)
    config = json.load(open(f"{path}/config.json"))
    config["topk_method"] = "hashed"
    json.dump(config, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError, match="topk_method 'hashed'.*greedy, group_limited_greedy"):
        build_model(path)


@pytest.mark.parametrize("parallel", [
    {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
    {"tensor_parallel_size": 2, "enable_expert_parallel": True}], ids=["tp2", "pp2", "ep2"])
def test_deepseek_parallel_matches_single_process(checkpoints, parallel):
    # TP splits the heads (each rank caches the full latent row) and the experts' intermediate
    # dimension; EP whole experts; PP puts the dense layer and the MoE layer on two stages.
    assert_parallel_matches_one_process(checkpoints["v3"], **parallel)


@pytest.mark.slow   # 8.5 s on 2 cores
def test_deepseek_online_fp8_absorbs_the_dequantised_kv_b_proj(checkpoints):
    # kv_b_proj's fp8 weight never runs as a linear: MLA absorbs its dequantised values.
    from minivllm.model_executor.layers.attention.mla_attention import MLAAttention
    from minivllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    path = checkpoints["v2_grouped"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    batch = make_prompts(1000, (9, 21))
    runs = {}
    for quantization in (None, "fp8"):
        llm = LLM(model=path, dtype="bfloat16", quantization=quantization, block_size=4)
        outs = llm.generate(batch, params, use_tqdm=False)
        runs[quantization] = torch.tensor([o.prompt_logprobs[i][ids[i]].logprob
                                           for o, ids in zip(outs, batch)
                                           for i in range(1, len(ids))])
    model = llm.llm_engine.executor.worker.model_runner.model
    kv_b = model.model.layers[0].self_attn.kv_b_proj
    assert isinstance(kv_b.quant_method, Fp8LinearMethod) and kv_b.weight.dtype.itemsize == 1
    mla = next(m for m in model.modules() if isinstance(m, MLAAttention))
    expected = kv_b.quant_method.dequantize_weight(kv_b).to(torch.bfloat16)
    assert torch.equal(mla.kv_b_weight(torch.bfloat16), expected)
    # W8A8 rounding against the bf16 run (see test_fp8.py's W8A8_ATOL for the scale of it).
    assert (runs["fp8"] - runs[None]).abs().max().item() <= 0.35


def test_deepseek_serves_peft_adapters_and_refuses_kv_b_proj(checkpoints, tmp_path):
    """LoRA on MLA's called projections (q_b_proj, the fused q_a / kv_a shards, o_proj) gives
    transformers + PEFT's tokens; kv_b_proj (absorbed, never called) is no target."""
    from minivllm.lora.request import LoRARequest
    from tests.lora._lora_helpers import assert_adapter_matches_peft, run, write_adapter

    base = checkpoints["v2_grouped"]
    # Attention only: for this model type PEFT turns MLP targets into adapters of transformers'
    # stacked expert tensors (target_parameters), a form minivllm's LoRA does not load.
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]
    adapter = write_adapter(base, str(tmp_path / "mla"), 2, targets)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4, num_gpu_blocks_override=64, max_model_len=64)
    prompts = [[5, 17, 300, 42, 7, 99, 3, 250, 11], [400, 8, 61, 2, 77]]
    assert_adapter_matches_peft(llm, base, adapter, prompts, LoRARequest("mla", 1, adapter))
    kv_b = write_adapter(base, str(tmp_path / "kv_b"), 3, ["kv_b_proj"])
    with pytest.raises(ValueError, match="kv_b_proj"):
        run(llm, prompts[:1], LoRARequest("kv_b", 2, kv_b))
    llm.shutdown()


def test_deepseek_under_torch_compile(checkpoints):
    """Compiled (inductor; MLA behind the opaque attention op, the absorbed matmuls inside it)
    gives the eager run's greedy tokens."""
    prompts = make_prompts(1000, (5, 17))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = [[list(o.outputs[0].token_ids)
             for o in LLM(model=checkpoints["v3"], dtype="float32", enforce_eager=eager)
             .generate(prompts, params, use_tqdm=False)] for eager in (True, False)]
    assert runs[0] == runs[1]


def test_fp8_kv_cache_is_refused_by_mla_layers(checkpoints):
    with pytest.raises(ValueError, match="fp8 caches serve the standard attention layers only"):
        LLM(model=checkpoints["v2_lite"], kv_cache_dtype="fp8")
