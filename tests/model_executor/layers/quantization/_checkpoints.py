"""Quantized tiny-Llama checkpoints written in the tests, their dequantised fp32 twins for
transformers, and the teacher-forced comparison of a minivllm run with transformers."""

import json
import os
import shutil
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT_LENS = [5, 17, 33]
NUM_TOKENS = 8

# name, fp32 weight [out, in] -> (tensors stored under name's module, dequantised fp32 weight)
Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def prompts(vocab_size: int = 1000) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def is_linear_weight(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_SUFFIXES


def write_quantized(src: str, dst: str, quantize: Quantizer, quant_config: dict,
                    skip: tuple[str, ...] = (), other_dtype: torch.dtype = torch.bfloat16) -> str:
    """`dst`: src's linears through `quantize` (modules in `skip` stay bf16), every other tensor in
    `other_dtype`, config.json with `quantization_config`; `dst + "_ref"`: the dequantised fp32 weights."""
    state = load_file(os.path.join(src, "model.safetensors"))
    stored, reference = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if is_linear_weight(name) and module not in skip:
            tensors, dequantised = quantize(name, tensor.float())
            stored.update({f"{module}.{suffix}": t.contiguous() for suffix, t in tensors.items()})
            reference[name] = dequantised.float()
        else:
            stored[name] = tensor.to(other_dtype)
            reference[name] = stored[name].float()
    for folder, tensors, extra in ((dst, stored, {"quantization_config": quant_config}),
                                   (dst + "_ref", reference, {})):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(src, "config.json")) as f:
            config = {**json.load(f), **extra}
        config.pop("dtype", None)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        if os.path.exists(os.path.join(src, "generation_config.json")):
            shutil.copy(os.path.join(src, "generation_config.json"), folder)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_reference_from_model(model: torch.nn.Module, src: str, dst: str) -> None:
    """`dst + "_ref"`: src with each quantized linear replaced by the weight the model holds,
    dequantised (fused layers split back into their checkpoint matrices)."""
    from minivllm.model_executor.models.llama import LlamaForCausalLM

    state = load_file(os.path.join(src, "model.safetensors"))
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "logical_widths"):
            continue   # unquantized layers keep the checkpoint's weights
        parent, _, leaf = name.rpartition(".")
        shards = LlamaForCausalLM.packed_modules_mapping.get(leaf, [leaf])
        for shard, part in zip(shards, method.dequantize_weight(module).split(module.logical_widths)):
            state[f"{parent}.{shard}.weight"] = part
    dtype = next(p.dtype for n, p in model.named_parameters() if n.endswith("norm.weight"))
    write_quantized(src, dst, lambda n, w: ({"weight": state[n]}, state[n]), {}, other_dtype=dtype)


def fp8_per_tensor(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = w.abs().max() / 448.0
    q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(())}, q.float() * scale


def fp8_block_quantizer(block: int) -> Quantizer:
    """Block-wise e4m3 with `weight_scale_inv` [n / block, k / block] (shapes divisible)."""
    def quantize(name: str, w: torch.Tensor):
        n, k = w.shape
        blocks = w.reshape(n // block, block, k // block, block)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)        # [n/b, k/b]
        q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        deq = (q.float() * scale[:, None, :, None]).reshape(n, k)
        return {"weight": q.reshape(n, k), "weight_scale_inv": scale}, deq
    return quantize


def fake_fp8_groups(group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's dynamic per-token-group fp8 rounding of activations (K divisible by `group`)."""
    def fake(x: torch.Tensor) -> torch.Tensor:
        g = x.reshape(*x.shape[:-1], -1, group)
        scale = (g.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
        q = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return q.reshape(x.shape)
    return fake


def run_greedy(llm: LLM, prompt_ids: list[list[int]]) -> list[dict]:
    """Our greedy tokens and the logprob of every prompt / generated token."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    results = []
    for ids, out in zip(prompt_ids, llm.generate(prompt_ids, params, use_tqdm=False)):
        c = out.outputs[0]
        lps = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        lps += [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
        results.append(dict(tokens=list(c.token_ids), logprobs=lps))
    return results


def fake_quant_inputs(model: torch.nn.Module, fake_quant: Callable[[torch.Tensor], torch.Tensor],
                      skip: tuple[str, ...] = ()) -> None:
    """Round the inputs of the model's quantized nn.Linear layers as a W8A8 kernel does."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEAR_SUFFIXES \
                and name not in skip:
            module.register_forward_pre_hook(lambda _m, args: (fake_quant(args[0]),))


@torch.inference_mode()
def check_against_transformers(ref_path: str, prompt_ids: list[list[int]], results: list[dict],
                               atol: float, prepare: Callable | None = None) -> float:
    """Teacher-forced on our tokens: each logprob within `atol` of transformers' (fp32, the
    dequantised weights), and each greedy token within `atol` of transformers' best. Returns the
    largest logprob difference."""
    model = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    if prepare is not None:
        prepare(model)
    worst = 0.0
    for ids, res in zip(prompt_ids, results):
        seq = ids + res["tokens"]
        ref = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), -1)
        chosen = ref.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        diff = (torch.tensor(res["logprobs"]) - chosen).abs().max().item()
        worst = max(worst, diff)
        assert diff <= atol, f"logprobs differ by {diff} > {atol}"
        best = ref[len(ids) - 1:].max(-1).values
        assert (best - chosen[len(ids) - 1:]).max().item() <= atol   # greedy up to near-ties
    return worst
