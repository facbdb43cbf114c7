"""Online int4 (`quantization="int4"`): round-to-nearest per group after loading an unquantized
checkpoint; the whole model against transformers running the same dequantised weights."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.model_executor.layers.quantization import get_quantization_config
from minivllm.model_executor.layers.quantization.int4 import Int4Config, quantize_int4

from tests.model_executor.layers.quantization._int4_checkpoints import LINEARS, hf_logprobs

CONFIG = dict(hidden_size=128, intermediate_size=256)   # every input size divides by 128
NUM_TOKENS = 8


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (7, 30)]


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_quantize_int4_rounds_to_nearest(group_size: int, sym: bool):
    weight = torch.randn(96, 256)
    weight[:, :group_size] = 0.0                              # an all-zero group
    codes, scales, zero_points = quantize_int4(weight, group_size, sym)
    assert codes.dtype == torch.int32 and 0 <= int(codes.min()) and int(codes.max()) <= 15
    assert scales.shape == zero_points.shape == (96, 256 // group_size)
    if sym:
        assert bool((zero_points == 8).all())
    # [N, K/g, g]: within half a step of the original, and the zero group exact
    deq = (codes.view(96, -1, group_size) - zero_points[..., None]) * scales[..., None]
    err = (deq - weight.view(96, -1, group_size)).abs()
    assert bool((err <= scales[..., None] * 0.5 + 1e-6).all())
    assert bool((deq[:, 0] == 0).all())


def test_config_defaults_and_errors():
    assert get_quantization_config("int4") is Int4Config
    config = Int4Config.from_config({})
    assert (config.group_size, config.sym) == (128, False)
    assert Int4Config.from_config({"group_size": 32, "sym": True}).sym
    with pytest.raises(ValueError, match="group_size 96 is not supported.*32, 64, 128"):
        Int4Config.from_config({"group_size": 96})
    with pytest.raises(ValueError, match="already quantized \\('awq'\\).*--quantization awq"):
        Int4Config.from_config({"quant_method": "awq", "bits": 4})


def _write_int4_reference(src: str, dst: str, group_size: int, sym: bool) -> str:
    """The checkpoint with each linear replaced by its int4 round trip (from the bf16 weights the
    engine loads), in fp32: what transformers should agree with."""
    state = load_file(os.path.join(src, "model.safetensors"))
    for name, weight in state.items():
        if name.removesuffix(".weight").endswith(LINEARS):
            codes, scales, zero_points = quantize_int4(weight.bfloat16(), group_size, sym)
            deq = (codes.view(weight.shape[0], -1, group_size) - zero_points[..., None]) \
                * scales[..., None]
            state[name] = deq.view(weight.shape).contiguous()
    os.makedirs(dst)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for extra in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, extra)):
            with open(os.path.join(src, extra)) as f, open(os.path.join(dst, extra), "w") as g:
                g.write(f.read())
    return dst


def _run(path: str, prompts: list[list[int]], **kwargs) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and the logprob of every prompt and generated token."""
    llm = LLM(model=path, dtype="bfloat16", block_size=4, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    results = []
    for ids, out in zip(prompts, llm.generate(prompts, params)):
        comp = out.outputs[0]
        lps = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        lps += [step[tok].logprob for step, tok in zip(comp.logprobs, comp.token_ids)]
        results.append((list(comp.token_ids), torch.tensor(lps, dtype=torch.float64)))
    return results


@pytest.mark.parametrize(("group_size", "sym"), [(128, False), (32, True)])
def test_online_int4_matches_transformers_on_its_dequantised_weights(
        tiny_llama_factory, tmp_path, group_size: int, sym: bool, monkeypatch):
    path = tiny_llama_factory("int4", **CONFIG)
    prompts = _prompts()
    monkeypatch.setattr(Int4Config, "from_config", classmethod(
        lambda cls, config: cls(group_size=group_size, sym=sym)))
    ours = _run(path, prompts, quantization="int4")
    ref_path = _write_int4_reference(path, str(tmp_path / "ref"), group_size, sym)
    refs = hf_logprobs(ref_path, [ids + tokens for ids, (tokens, _) in zip(prompts, ours)])
    for ids, (tokens, lps), ref in zip(prompts, ours, refs):
        # teacher-forced on our tokens: a bf16 near-tie may pick the other token
        chosen = ref.gather(1, torch.tensor(ids[1:] + tokens)[:, None])[:, 0]
        assert (lps - chosen).abs().max().item() <= 0.1
        best = ref[len(ids) - 1:].max(-1).values
        assert (best - chosen[len(ids) - 1:]).max().item() <= 0.1


def test_online_int4_stays_close_to_the_bf16_model(tiny_llama_factory):
    path = tiny_llama_factory("int4", **CONFIG)
    prompts = _prompts()
    base = _run(path, prompts)
    quant = _run(path, [ids + tokens for ids, (tokens, _) in zip(prompts, base)],
                 quantization="int4")
    # The int4 model scores the bf16 model's tokens about as the bf16 model does: its ~10%
    # weight error moves this random tiny model's logprobs by a fraction of their spread.
    for (tokens, base_lp), (_, quant_lp) in zip(base, quant):
        quant_lp = quant_lp[:len(base_lp)]
        assert torch.corrcoef(torch.stack([base_lp, quant_lp]))[0, 1] > 0.9
        assert (quant_lp - base_lp).abs().mean() < 0.35 * base_lp.std()
