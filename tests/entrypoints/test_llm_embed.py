"""LLM.embed / LLM.encode on tiny random Llamas: equal to transformers' hidden states pooled by
hand (fp32), chunked prefill equal to unchunked, the runner / convert / pooler_config flags."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaModel

from minivllm import LLM, SamplingParams
from minivllm.pooling_params import PoolingParams
from tests.conftest import TINY_LLAMA, write_tiny_llama

PROMPT_LENS = [5, 17, 33, 2]
ATOL = 1e-4


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def base_model_path(tmp_path_factory) -> str:
    """A HF `LlamaModel` checkpoint (no LM head, weights without the `model.` prefix)."""
    folder = str(tmp_path_factory.mktemp("llama_base"))
    torch.manual_seed(0)
    LlamaModel(LlamaConfig(**TINY_LLAMA, architectures=["LlamaModel"])).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(base_model_path) -> list[torch.Tensor]:
    """transformers' last hidden states (after the final norm), fp32, one `[n, H]` per prompt."""
    model = LlamaModel.from_pretrained(base_model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in _prompts()]


def _llm(path: str, **kwargs) -> LLM:
    # A small KV cache: allocating the default 1 GiB one takes seconds.
    return LLM(path, dtype="float32", max_model_len=64, block_size=4, num_gpu_blocks_override=64,
               **kwargs)


@pytest.fixture(scope="module")
def auto_llm(base_model_path):
    llm = _llm(base_model_path)
    yield llm
    llm.shutdown()


def test_llama_model_is_an_embedding_model_last_pooling_normalised(auto_llm, reference):
    config = auto_llm.vllm_config.model_config
    assert (config.runner_type, config.convert_type) == ("pooling", "embed")
    assert not auto_llm.vllm_config.cache_config.enable_prefix_caching
    outputs = auto_llm.embed(_prompts(), use_tqdm=False)
    for out, ref, prompt in zip(outputs, reference, _prompts()):
        emb = torch.tensor(out.outputs.embedding)
        assert out.prompt_token_ids == prompt and out.finished
        assert torch.allclose(emb, F.normalize(ref[-1], dim=-1), atol=ATOL)
        assert emb.norm().item() == pytest.approx(1.0, abs=1e-5)
    assert auto_llm.llm_engine.scheduler.kv_cache_usage == 0   # no KV kept after pooling


@pytest.mark.slow
def test_tensor_parallel_embeddings_equal_one_rank(base_model_path, reference):
    llm = _llm(base_model_path, tensor_parallel_size=2, max_num_batched_tokens=8)
    outputs = llm.embed(_prompts(), use_tqdm=False)
    llm.shutdown()
    for out, ref in zip(outputs, reference):
        assert torch.allclose(torch.tensor(out.outputs.embedding), F.normalize(ref[-1], dim=-1),
                              atol=ATOL)


def test_generate_on_a_pooling_model_names_the_runner(auto_llm):
    with pytest.raises(ValueError, match="runner='pooling'"):
        auto_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


def test_dimensions_refused_without_matryoshka(auto_llm):
    with pytest.raises(ValueError, match="matryoshka"):
        auto_llm.embed([[5, 6, 7]], PoolingParams(dimensions=8))


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "ALL"])
def test_pooler_config_override_and_chunked_prefill(base_model_path, reference, pooling_type):
    # A 6-token budget splits every long prompt into chunks; the pooled result must not change.
    llm = _llm(base_model_path, max_num_batched_tokens=6,
               pooler_config=json.dumps({"pooling_type": pooling_type, "normalize": False}))
    outputs = llm.encode(_prompts(), use_tqdm=False)
    llm.shutdown()
    for out, ref in zip(outputs, reference):
        expected = {"MEAN": ref.mean(0), "CLS": ref[0], "ALL": ref}[pooling_type]
        assert out.outputs.data.shape == expected.shape
        assert torch.allclose(out.outputs.data, expected, atol=ATOL)


def test_causal_lm_converted_to_embed_mean_matches_hf(tmp_path):
    from transformers import LlamaForCausalLM

    path = write_tiny_llama(str(tmp_path), matryoshka_dimensions=[16, 32])
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # The ranking of flags: sentence-transformers files give MEAN + Normalize here.
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize"}], f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, f)
    llm = _llm(path, convert="embed", max_num_batched_tokens=8)
    assert llm.vllm_config.model_config.pooler_config.effective_pooling_type == "MEAN"
    outputs = llm.embed(_prompts(), use_tqdm=False)
    # A matryoshka model's embeddings cut to `dimensions`, then renormalised.
    short = llm.embed(_prompts(), PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(ValueError, match=r"supports \[16, 32\]"):
        llm.embed([[5, 6]], PoolingParams(dimensions=8))
    llm.shutdown()
    with torch.inference_mode():
        for out, cut, prompt in zip(outputs, short, _prompts()):
            ref = hf.model(torch.tensor([prompt])).last_hidden_state[0].mean(0)
            assert torch.allclose(torch.tensor(out.outputs.embedding), F.normalize(ref, dim=-1),
                                  atol=ATOL)
            assert torch.allclose(torch.tensor(cut.outputs.embedding),
                                  F.normalize(ref[:16], dim=-1), atol=ATOL)


def test_embeddings_with_a_lora_adapter_match_peft(tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from minivllm.lora.request import LoRARequest
    from tests.lora._lora_helpers import ATTENTION, write_adapter

    path = write_tiny_llama(str(tmp_path / "base"))
    adapter = write_adapter(path, str(tmp_path / "adapter"), 1, ATTENTION)
    llm = _llm(path, convert="embed", enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("a", 1, adapter)
    prompt = _prompts()[1]
    adapted, base = llm.embed([prompt, prompt], use_tqdm=False, lora_request=[lora, None])
    llm.shutdown()
    hf = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(path, dtype=torch.float32),
                                   adapter).eval()
    with torch.inference_mode():
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
    assert torch.allclose(torch.tensor(adapted.outputs.embedding),
                          F.normalize(hidden[0, -1], dim=-1), atol=ATOL)
    assert not torch.allclose(torch.tensor(base.outputs.embedding),
                              torch.tensor(adapted.outputs.embedding), atol=1e-2)


def test_embed_on_a_generate_model_names_the_runner_flag(tiny_llama_factory):
    llm = _llm(tiny_llama_factory())
    try:
        assert llm.vllm_config.model_config.runner_type == "generate"
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.embed([[5, 6, 7]])
    finally:
        llm.shutdown()


def test_bidirectional_model_prefills_whole_prompts(tmp_path):
    folder = str(tmp_path)
    torch.manual_seed(0)
    hf = LlamaModel(LlamaConfig(**TINY_LLAMA)).eval()
    hf.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:   # save_pretrained names the class
        json.dump({**config, "architectures": ["LlamaBidirectionalModel"]}, f)
    # A chunk would not see the later ones: one whole prompt per step.
    llm = _llm(folder, max_num_batched_tokens=16,
               pooler_config={"pooling_type": "MEAN", "normalize": False})
    scheduler_config = llm.vllm_config.scheduler_config
    assert (scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs) == (64, 1)
    assert llm.vllm_config.model_config.runner_type == "pooling"
    outputs = llm.encode(_prompts(), use_tqdm=False)
    llm.shutdown()
    with torch.inference_mode():
        for out, prompt in zip(outputs, _prompts()):
            # transformers with every key visible (a zero 4-D mask), fp32
            visible = torch.zeros(1, 1, len(prompt), len(prompt))
            ref = hf(torch.tensor([prompt]), attention_mask=visible).last_hidden_state[0]
            assert torch.allclose(out.outputs.data, ref.mean(0), atol=ATOL)


def test_runner_flags_are_validated(tiny_llama_factory):
    path = tiny_llama_factory()
    with pytest.raises(ValueError, match="choose one of auto, generate, pooling"):
        _llm(path, runner="embedding")
    with pytest.raises(ValueError, match="--convert embed"):
        _llm(path, runner="pooling", convert="none")
    with pytest.raises(ValueError, match="--runner pooling"):
        _llm(path, runner="generate", convert="embed")
    with pytest.raises(ValueError, match="valid keys"):
        _llm(path, runner="pooling", pooler_config='{"pooling": "MEAN"}')
    with pytest.raises(ValueError, match="choose one of LAST, MEAN, CLS, ALL"):
        _llm(path, runner="pooling", pooler_config='{"pooling_type": "MAX"}')
