"""quantization="gguf": weights stay in their GGUF block formats; logits match transformers.

transformers dequantises the same file to fp32, so the remaining difference is minivllm's
per-block int8 quantization of the activations (as llama.cpp does): its relative error is about
1/254 of each 32-value block's maximum per product, so prompt logprobs agree to a few 1e-2
on this tiny random model (its dequantising path agrees to 1e-4).
"""

import gguf
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model_executor.layers.quantization.gguf import (GGUFConfig, GGUFEmbeddingMethod,
                                                              GGUFLinearMethod)
from tests.model_executor.layers.quantization._gguf_helpers import (hf_logits_of_gguf,
                                                                    write_tiny_gguf)

pytestmark = pytest.mark.requires_native
LEGACY_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64, 128, 11]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    cache: dict[tuple[str, bool], str] = {}

    def make(qtype: str, tied: bool = False) -> str:
        if (qtype, tied) not in cache:
            folder = str(tmp_path_factory.mktemp(f"gguf_{qtype}_{tied}"))
            cache[qtype, tied] = write_tiny_gguf(folder, qtype, tie_word_embeddings=tied)
        return cache[qtype, tied]

    return make


def _model(llm: LLM):
    return llm.llm_engine.executor.worker.model_runner.model


def _prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    out = llm.generate([ids], params)[0]
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


def _hf_prompt_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    logprobs = torch.log_softmax(hf_logits_of_gguf(path, ids).double(), -1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("qtype", LEGACY_TYPES)
def test_logits_match_transformers_on_the_dequantised_file(gguf_files, qtype):
    path = gguf_files(qtype)
    llm = LLM(model=path, dtype="float32", max_num_batched_tokens=256)
    ours = _prompt_logprobs(llm, PROMPT)
    ref = _hf_prompt_logprobs(path, PROMPT)
    # Measured 0.019-0.033 over the five types (the int8 activations); the weights are exact.
    assert (ours.double() - ref).abs().max().item() < 6e-2
    # The dequantising reference path of the same file is exact up to fp32 rounding.
    ref_llm = LLM(model=path, dtype="float32", quantization="none", max_num_batched_tokens=256)
    assert (_prompt_logprobs(ref_llm, PROMPT).double() - ref).abs().max().item() < 1e-4


def test_weights_stay_packed_and_the_tied_head_shares_them(gguf_files):
    path = gguf_files("Q4_1", tied=True)
    llm = LLM(model=path, dtype="bfloat16")
    model = _model(llm)
    assert isinstance(llm.llm_engine.vllm_config.quant_config, GGUFConfig)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, GGUFLinearMethod)
    assert qkv.qweight.dtype == torch.uint8 and qkv.qweight_type == gguf.GGMLQuantizationType.Q4_1
    # [q + k + v rows, 64 inputs / 32 per block * 20 bytes per Q4_1 block]
    assert tuple(qkv.qweight.shape) == (64 + 2 * 32, 2 * 20)
    embed, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embed.quant_method, GGUFEmbeddingMethod)
    assert head.qweight is embed.qweight and head.qweight.dtype == torch.uint8
    float_params = [n for n, p in model.named_parameters() if p.dim() == 2 and p.is_floating_point()]
    assert float_params == []           # no dequantised copy of any matrix
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ref = LLM(model=path, dtype="bfloat16", quantization="none").generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    assert out[0].outputs[0].token_ids[:4] == ref[0].outputs[0].token_ids[:4]


def test_the_lm_head_rows_are_independent(gguf_files, monkeypatch):
    """The GGUF LM head multiplies the sampled positions (a row per request, after the forward
    pass) as independent rows (gguf_linear's int8 tiles for any count of them where decode steps
    take them); the body's linears do not claim that."""
    from minivllm.model_executor.kernels import gguf_linear as gl

    model = _model(LLM(model=gguf_files("Q4_1", tied=True), dtype="bfloat16"))
    seen = []
    real = gl.gguf_linear
    monkeypatch.setattr(gl, "gguf_linear", lambda *a, independent_rows=False, **kw:
                        seen.append(independent_rows) or real(*a, independent_rows=independent_rows,
                                                              **kw))
    x = torch.randn(6, 64).bfloat16()
    logits = model.lm_head.quant_method.apply(model.lm_head, x)
    assert seen == [True] and logits.shape[0] == 6
    model.model.layers[0].self_attn.qkv_proj(x)
    assert seen == [True, False]


def test_quantization_choices_and_conflicts(gguf_files, tiny_llama_factory):
    path = gguf_files("Q8_0")
    with pytest.raises(ValueError, match=r"Invalid quantization method 'q9'.*gguf.*fp8"):
        LLM(model=path, quantization="q9")
    with pytest.raises(ValueError, match="quantized with 'gguf'"):
        LLM(model=path, quantization="fp8")
    assert LLM(model=path, quantization="none").llm_engine.vllm_config.quant_config is None


def test_unsupported_gguf_type_is_named(tmp_path):
    """A tensor type without a kernel is an error naming it, never a silent dequantise."""
    from minivllm.model_executor.kernels.gguf_linear import check_gguf_type

    with pytest.raises(ValueError, match="IQ2_XS"):
        check_gguf_type(int(gguf.GGMLQuantizationType.IQ2_XS), "model.layers.0.mlp.down_proj")


def test_tp_that_splits_a_block_is_refused_with_the_valid_sizes(gguf_files):
    """Row-parallel layers shard whole blocks of input columns: 64 inputs / TP 4 = 16 values,
    half a 32-value block, so TP=4 is refused, naming the sizes that work."""
    path = gguf_files("Q8_0")
    with pytest.raises(Exception, match=r"valid tensor_parallel_size values for this layer: "
                                        r"\[1, 2\]"):
        LLM(model=path, tensor_parallel_size=4, dtype="float32")


def test_prefix_caching_and_preemption_keep_greedy_tokens(gguf_files):
    """The packed path under forced preemption and prefix caching: the same tokens as alone."""
    path = gguf_files("Q4_0")
    gen = torch.Generator().manual_seed(3)
    vocab = LLM(model=path, dtype="float32").llm_engine.vllm_config.model_config.get_vocab_size()
    shared = torch.randint(3, vocab, (24,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 30, (12,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone_llm = LLM(model=path, dtype="float32", block_size=4)
    alone = [alone_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    llm = LLM(model=path, dtype="float32", block_size=4, num_gpu_blocks_override=32,
              max_model_len=128, enable_prefix_caching=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_compiled_model_keeps_the_packed_ops_opaque(gguf_files):
    """--compile: the GGUF lookup and linears are opaque ops (no graph break at the native
    calls) and the compiled model picks the eager model's greedy tokens."""
    from torch._dynamo.utils import counters

    path = gguf_files("Q8_0", tied=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eager = LLM(model=path, dtype="bfloat16").generate([PROMPT], params)[0].outputs[0].token_ids
    counters.clear()
    compiled = LLM(model=path, dtype="bfloat16", enforce_eager=False)
    assert compiled.generate([PROMPT], params)[0].outputs[0].token_ids == eager
    assert dict(counters["graph_break"]) == {}
