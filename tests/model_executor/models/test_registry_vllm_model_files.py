"""vLLM 0.33.0's own model files, import root renamed, run on minivllm and match transformers
(32 files: the 24 families minivllm ships its own files for, and 8 it has none of).

Each file is registered over minivllm's class for its architecture, then a tiny random
transformers checkpoint of the family runs through `LLM`: fp32 greedy tokens identical and prompt
logprobs within 1e-4 (`assert_matches_transformers`). Further tests run vLLM's files under
check-model, over TP / EP / PP worker processes, on packed GGUF files, with LoRA adapters and on
the embedded default model. The files come from vLLM's source distribution on PyPI (47 MB,
fetched once and cached; see `_vllm_files`), the same index `make test` installs from; ~70 s
on 2 cores.
"""

import pytest
import torch
import transformers

from tests.model_executor.models._family_helpers import (assert_matches_transformers,
                                                         build_model, write_tiny_checkpoint)

_MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
_LOCAL_EXPERTS = dict(num_local_experts=8, num_experts_per_tok=2)
# vLLM file -> (transformers class, its config class, vLLM's class, config overrides)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", None, {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", None, {}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", None, {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", None, dict(head_dim=32)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", None, dict(head_dim=16)),
    # vLLM's Gemma 2 and Cohere always tie the LM head to the embedding, as their checkpoints do.
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", None,
               dict(head_dim=16, tie_word_embeddings=True)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", None, dict(head_dim=16)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", None, {}),
    "granite": ("GraniteForCausalLM", "GraniteConfig", None, {}),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", "StablelmForCausalLM", {}),
    "glm4": ("Glm4ForCausalLM", "Glm4Config", None, {}),
    "commandr": ("CohereForCausalLM", "CohereConfig", None,
                 dict(rms_norm_eps=None, layer_norm_eps=1e-5, logit_scale=0.5,
                      tie_word_embeddings=True)),
    # MoE families: vLLM 0.33's FusedMoEFactory / MoERunner / GateLinear surface.
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", None, _LOCAL_EXPERTS),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", None,
                  dict(_MOE, shared_expert_intermediate_size=48)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", None,
                  dict(_MOE, head_dim=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", None, dict(num_experts=8, num_experts_per_tok=2)),
    # vLLM's PhiMoE has attention and LM-head biases, as PhiMoE checkpoints do.
    "phimoe": ("PhimoeForCausalLM", "PhimoeConfig", "PhiMoEForCausalLM",
               dict(_LOCAL_EXPERTS, attention_bias=True, lm_head_bias=True)),
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", None, _LOCAL_EXPERTS),
    # Attention sinks, sliding windows on alternate layers, YaRN, biased experts whose gate / up
    # columns interleave ("swigluoai"), loaded by the file's own loop into the routed experts.
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", None,
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                     head_dim=16, sliding_window=8,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False,
                                      "rope_theta": 150000.0,
                                      "original_max_position_embeddings": 64})),
    # Built on vLLM's granitemoe.py, which the port brings along (minivllm's granitemoe.py
    # lacks the GraniteMoeAttention it imports).
    "granitemoeshared": ("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig", None,
                         dict(_LOCAL_EXPERTS, shared_intermediate_size=48)),
    # Families minivllm has no file of its own for: vLLM's file is the only implementation.
    "ernie45_moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", None,
                    dict(moe_intermediate_size=32, moe_num_experts=8, moe_k=2)),
    "apertus": ("ApertusForCausalLM", "ApertusConfig", None, {}),
    "bloom": ("BloomForCausalLM", "BloomConfig", None, dict(n_head=4, tie_word_embeddings=True)),
    "ernie45": ("Ernie4_5ForCausalLM", "Ernie4_5Config", None, {}),
    # EXAONE: sliding-window layers (window 16: the prompts are longer) beside global ones.
    "exaone4": ("Exaone4ForCausalLM", "Exaone4Config", None, dict(sliding_window=16)),
    # On vLLM's exaone4.py (ported alongside): experts with a shared one, a correction bias.
    "exaone_moe": ("ExaoneMoeForCausalLM", "ExaoneMoeConfig", None,
                   dict(_MOE, sliding_window=16)),
    # GLM-4.5-style MoE: sigmoid scores with a correction bias, grouped top-k, routed scaling
    # applied to the output, a shared expert, a dense first layer, partial RoPE, QK norm.
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", None,
                 dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                      n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                      routed_scaling_factor=2.5, head_dim=16, partial_rotary_factor=0.5,
                      use_qk_norm=True)),
    "gpt_j": ("GPTJForCausalLM", "GPTJConfig", None, dict(n_head=4, rotary_dim=8)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", None,
             dict(n_head=4, n_positions=512, tie_word_embeddings=True)),
    "nemotron": ("NemotronForCausalLM", "NemotronConfig", None, {}),
    "opt": ("OPTForCausalLM", "OPTConfig", None, dict(ffn_dim=128, word_embed_proj_dim=64)),
}
# vLLM's Bloom runs the exact GELU where transformers' runs the tanh approximation: the same
# greedy tokens, logprobs ~3e-4 apart on these random weights (vLLM's own deviation).
TOLERANCE = {"bloom": 1e-3}


@pytest.mark.parametrize("file", sorted(FAMILIES))
def test_vllm_file_matches_transformers(file, registered_vllm_class, tmp_path):
    hf_name, config_name, cls_name, overrides = FAMILIES[file]
    cls = registered_vllm_class(file, hf_name, cls_name)
    assert f"._checked_{file}_" in cls.__module__      # vLLM's class, not minivllm's own
    path = write_tiny_checkpoint(tmp_path, getattr(transformers, config_name),
                                 getattr(transformers, hf_name), **overrides)
    assert type(build_model(path)) is cls              # the registry hands out vLLM's class
    assert_matches_transformers(path, atol=TOLERANCE.get(file, 1e-4))


@pytest.mark.parametrize("file", ["qwen3_moe", "glm4_moe", "gpt_oss"])
def test_check_model_passes_on_the_vllm_file_at_tp2(file, tmp_path):
    """`minivllm check-model --model-file <vLLM's file>:Class --hf -tp 2`: every section passes,
    with two real ranks loading vLLM's file through check-model's temporary plugin."""
    from minivllm.entrypoints.check_model import CheckOptions, run_checks
    from tests.model_executor.models._vllm_files import vllm_models_dir

    hf_name, config_name, cls_name, overrides = FAMILIES[file]
    path = write_tiny_checkpoint(tmp_path, getattr(transformers, config_name),
                                 getattr(transformers, hf_name), **overrides)
    spec = f"{vllm_models_dir() / file}.py:{cls_name or hf_name}"
    report = run_checks(CheckOptions(path, hf=True, model_file=spec, tensor_parallel_size=2))
    assert {s.status for s in report.sections.values()} == {"pass"}, report.to_text()
    assert report.sections["numerics"].data["first_divergence"] is None


@pytest.mark.requires_native
@pytest.mark.parametrize("file", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_vllm_moe_file_on_a_packed_gguf(file, registered_vllm_class, tmp_path):
    """A Q8_0 GGUF of the family through vLLM's file: the experts stay packed (the GGUF method
    matched by prefix on the runner's routed experts), the router arrives dequantised, a layer
    the file builds without the quant config (Mixtral's embedding) gets its weight dequantised;
    greedy tokens equal transformers' on the dequantised weights."""
    import os

    from safetensors.torch import load_file

    from minivllm.model_executor.layers.fused_moe import RoutedExperts
    from minivllm.model_executor.layers.quantization.gguf_moe import GGUFMoEMethod
    from tests.model_executor.model_loader.test_gguf_loader_moe import write_moe_gguf
    from tests.model_executor.models._family_helpers import make_prompts

    hf_name, _, cls_name, _ = FAMILIES[file]
    registered_vllm_class(file, hf_name, cls_name)
    path, hf_dir = write_moe_gguf(str(tmp_path), file)
    model = build_model(path, quantization="gguf")
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(isinstance(m.quant_method, GGUFMoEMethod) for m in experts)
    vocab = len(load_file(os.path.join(hf_dir, "model.safetensors"))["model.embed_tokens.weight"])
    assert_matches_transformers(path, prompts=make_prompts(vocab, (7, 33)), num_tokens=8,
                                reference=hf_dir, quantization="gguf")


@pytest.mark.parametrize("file, parallel", [
    ("qwen3_moe", dict(tensor_parallel_size=2)),
    ("gpt_oss", dict(tensor_parallel_size=2)),
    ("gpt_oss", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("mixtral", dict(pipeline_parallel_size=2))])
def test_vllm_moe_file_in_parallel_equals_one_process(file, parallel, registered_vllm_class,
                                                      tmp_path):
    """Real gloo worker processes run vLLM's file (each loads it through check-model's
    temporary plugin): TP slices the experts and sinks in the file's own loader, EP hands out
    whole experts, PP splits the layers; greedy tokens equal one process's, logprobs to 1e-5.
    The copy of the file the ranks load marks every process that builds the model."""
    import os

    from minivllm import LLM
    from minivllm.entrypoints.check_model.build import model_file_plugin
    from tests._parallel_helpers import engine_kwargs, greedy_run, prompts
    from tests.model_executor.models._vllm_files import vllm_models_dir

    hf_name, config_name, cls_name, overrides = FAMILIES[file]
    cls_name = cls_name or hf_name
    registered_vllm_class(file, hf_name, cls_name)
    path = write_tiny_checkpoint(tmp_path / "ckpt", getattr(transformers, config_name),
                                 getattr(transformers, hf_name), **overrides)
    reference = greedy_run(LLM(model=path, **engine_kwargs()), prompts())
    marks = tmp_path / "marks"
    marks.mkdir()
    copy = tmp_path / f"{file}.py"
    copy.write_text((vllm_models_dir() / f"{file}.py").read_text() + f"""
import functools
_built = {cls_name}.__init__
@functools.wraps(_built)                  # the signature stays (the loader reads vllm_config)
def _marked_init(self, *args, **kwargs):
    import os
    open(os.path.join({str(marks)!r}, str(os.getpid())), "w").close()
    _built(self, *args, **kwargs)
{cls_name}.__init__ = _marked_init
""")
    with model_file_plugin(f"{copy}:{cls_name}", hf_name):
        llm = LLM(model=path, **engine_kwargs(**parallel))
        tokens, logprobs = greedy_run(llm, prompts())
        llm.shutdown()
    ranks = {int(p) for p in os.listdir(marks)} - {os.getpid()}
    assert len(ranks) == 2                              # both worker ranks built vLLM's class
    assert tokens == reference[0]
    torch.testing.assert_close(logprobs, reference[1], rtol=0, atol=1e-5)


_FALCON = dict(tie_word_embeddings=True, layer_norm_epsilon=1e-5, rms_norm_eps=None,
               intermediate_size=None, num_key_value_heads=None)


@pytest.mark.parametrize("variant", [
    dict(multi_query=True, parallel_attn=True, bias=False),                    # falcon-7b
    dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True),   # falcon-40b
    dict(alibi=True, bias=True, multi_query=False, parallel_attn=False)],      # falcon-rw-1b
    ids=["7b", "40b", "rw_alibi"])
def test_vllm_falcon_file_matches_transformers(variant, registered_vllm_class, tmp_path):
    """vLLM's falcon.py (minivllm has no Falcon file): multi-query parallel blocks, the new
    decoder architecture's grouped KV heads, ALiBi with biases."""
    registered_vllm_class("falcon", "FalconForCausalLM", None)
    path = write_tiny_checkpoint(tmp_path, transformers.FalconConfig,
                                 transformers.FalconForCausalLM, **_FALCON, **variant)
    assert_matches_transformers(path)


def test_vllm_falcon_file_on_a_refinedweb_checkpoint(registered_vllm_class, tmp_path):
    """The same weights under a legacy RefinedWebModel config.json (`RWForCausalLM`, read as
    RWConfig) give transformers' tokens on the modern folder."""
    import json
    import shutil

    registered_vllm_class("falcon", "RWForCausalLM", "FalconForCausalLM")
    hf = write_tiny_checkpoint(tmp_path / "hf", transformers.FalconConfig,
                               transformers.FalconForCausalLM, **_FALCON, multi_query=True,
                               parallel_attn=True, bias=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(tmp_path / "hf" / "model.safetensors", legacy)
    (legacy / "config.json").write_text(json.dumps({
        "model_type": "RefinedWebModel", "architectures": ["RWForCausalLM"],
        "n_head": config["num_attention_heads"], "n_layer": config["num_hidden_layers"],
        "n_embed": config["hidden_size"], "vocab_size": config["vocab_size"],
        "multi_query": True, "parallel_attn": True, "bias": False, "alibi": False,
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}))
    assert_matches_transformers(str(legacy), reference=hf)


def test_vllm_gpt2_sequence_classifier_through_the_pooling_engine(registered_vllm_class, tmp_path):
    """vLLM's GPT2ForSequenceClassification (its `DispatchPooler.for_seq_cls`) under
    `runner="pooling"`: each prompt's last-token logits equal transformers'."""
    from minivllm import LLM
    from tests.model_executor.models._family_helpers import make_prompts

    registered_vllm_class("gpt2", "GPT2ForSequenceClassification", None)
    path = write_tiny_checkpoint(tmp_path, transformers.GPT2Config,
                                 transformers.GPT2ForSequenceClassification, n_head=4,
                                 n_positions=512, num_labels=3)
    prompts = make_prompts(1000, (5, 17, 40))
    hf = transformers.GPT2ForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = [hf(torch.tensor([ids])).logits[0] for ids in prompts]
    llm = LLM(model=path, dtype="float32", runner="pooling")
    outputs = llm.encode([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(torch.as_tensor(out.outputs.data), ref, rtol=1e-5, atol=1e-5)


def _variants() -> dict[str, tuple]:
    """The harder configurations of minivllm's own family tests, through vLLM's files:
    (file, transformers class, config class, vLLM class, config overrides, engine kwargs)."""
    from tests.model_executor.models import test_commandr, test_gemma2_gemma3, test_phi3

    return {
        # Gemma 2: soft-capped attention and logits, alternating window-8 layers.
        "gemma2_softcap_swa": ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", None,
                               dict(test_gemma2_gemma3.GEMMA2, tie_word_embeddings=True), {}),
        # Gemma 3: window-8 local layers with their own RoPE base, linear-scaled global ones.
        "gemma3_local_global": ("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", None,
                                test_gemma2_gemma3.GEMMA3, {}),
        # Command-R7B (Cohere2): sliding layers beside position-free global ones. vLLM's file
        # widens the window by one token ("the training convention"), so transformers runs
        # the same weights with window 9 as the reference.
        "cohere2": ("commandr", "Cohere2ForCausalLM", "Cohere2Config", "CohereForCausalLM",
                    dict(test_commandr.BASE, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"]),
                    dict(reference_config={"sliding_window": 9})),
        # Phi-3 LongRoPE with partial rotary, prompts past the original context (long factors).
        "phi3_longrope": ("phi3", "Phi3ForCausalLM", "Phi3Config", None,
                          dict(rms_norm_eps=1e-5, max_position_embeddings=256, pad_token_id=0,
                               original_max_position_embeddings=test_phi3.ORIGINAL_MAX,
                               partial_rotary_factor=0.5,
                               rope_parameters=test_phi3._longrope(4)),
                          dict(prompt_lens=(70, 90), num_tokens=16)),
        "mistral_swa": ("mistral", "MistralForCausalLM", "MistralConfig", None,
                        dict(sliding_window=8), {}),
    }


@pytest.mark.parametrize("variant", ["gemma2_softcap_swa", "gemma3_local_global", "cohere2",
                                     "phi3_longrope", "mistral_swa"])
def test_vllm_file_variant_matches_transformers(variant, registered_vllm_class, tmp_path):
    from tests.model_executor.models._family_helpers import make_prompts

    file, hf_name, config_name, cls_name, overrides, run = _variants()[variant]
    registered_vllm_class(file, hf_name, cls_name)
    path = write_tiny_checkpoint(tmp_path, getattr(transformers, config_name),
                                 getattr(transformers, hf_name), **overrides)
    prompts = make_prompts(1000, run["prompt_lens"]) if "prompt_lens" in run else None
    reference = None
    if "reference_config" in run:
        import json
        import shutil

        reference = tmp_path / "reference"
        shutil.copytree(path, reference)
        config = json.loads((reference / "config.json").read_text())
        (reference / "config.json").write_text(json.dumps({**config, **run["reference_config"]}))
    assert_matches_transformers(path, prompts=prompts, num_tokens=run.get("num_tokens", 24),
                                reference=None if reference is None else str(reference))


def test_vllm_llama_file_serves_peft_adapters(registered_vllm_class, tiny_llama_factory,
                                              tmp_path):
    """LoRA matched by prefix on vLLM's llama.py: an all-linear PEFT adapter (fused q/k/v and
    gate/up shards included) gives transformers + PEFT's tokens, and changes the base's."""
    from minivllm import LLM
    from minivllm.lora.request import LoRARequest
    from tests.lora._lora_helpers import ALL_LINEAR, assert_adapter_matches_peft, write_adapter

    registered_vllm_class("llama", "LlamaForCausalLM", None)
    base = tiny_llama_factory("vllm_file_lora_base")
    adapter = write_adapter(base, str(tmp_path / "all"), 2, ALL_LINEAR)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4, num_gpu_blocks_override=64, max_model_len=64)
    prompts = [[5, 17, 300, 42, 7, 99, 3, 250, 11], [400, 8, 61, 2, 77]]
    assert_adapter_matches_peft(llm, base, adapter, prompts, LoRARequest("all", 1, adapter))
    llm.shutdown()


@pytest.mark.requires_native
def test_vllm_llama_file_serves_the_default_model_packed(registered_vllm_class,
                                                         default_model_path):
    """vLLM's llama.py on the embedded Q4_1 GGUF (tied embeddings, packed GGUF methods matched by
    prefix): the same greedy chat answer, token for token, as minivllm's own Llama file."""
    from minivllm import LLM, SamplingParams
    from minivllm.model_executor.layers.quantization.gguf import GGUFLinearMethod

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    own = LLM(model=default_model_path).chat(chat, params, use_tqdm=False)[0].outputs[0]
    cls = registered_vllm_class("llama", "LlamaForCausalLM", None)
    llm = LLM(model=default_model_path)
    model = llm.llm_engine.executor.worker.model_runner.model
    assert type(model) is cls
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.quant_method, GGUFLinearMethod)
    theirs = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    assert list(theirs.token_ids) == list(own.token_ids)
    assert theirs.text.startswith("The capital of France is Paris")


@pytest.mark.requires_native
def test_vllm_moe_file_under_torch_compile(registered_vllm_class, tmp_path):
    """vLLM's qwen3_moe.py compiled (`support_torch_compile`, inductor; the MoE runner traced)
    gives the eager run's greedy tokens."""
    from minivllm import LLM, SamplingParams
    from tests.model_executor.models._family_helpers import make_prompts

    hf_name, config_name, cls_name, overrides = FAMILIES["qwen3_moe"]
    registered_vllm_class("qwen3_moe", hf_name, cls_name)
    path = write_tiny_checkpoint(tmp_path, getattr(transformers, config_name),
                                 getattr(transformers, hf_name), **overrides)
    prompts, params = make_prompts(1000, (5, 17)), SamplingParams(temperature=0, max_tokens=8,
                                                                  ignore_eos=True)
    runs = [[list(o.outputs[0].token_ids) for o in LLM(model=path, dtype="float32",
                                                       enforce_eager=eager).generate(
                 prompts, params, use_tqdm=False)] for eager in (True, False)]
    assert runs[0] == runs[1]
