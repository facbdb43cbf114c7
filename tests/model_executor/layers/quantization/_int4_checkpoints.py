"""Tiny AWQ / GPTQ checkpoints written here with reference packers that follow each format's
documented layout (not minivllm's code), plus the transformers reference for them.

`write_quantized_llama(src, dst, method, ...)` quantizes the seven Linear weights of every layer
of a tiny fp32 HF Llama (round to nearest, per group) and writes
- `dst/quantized`: config.json with `quantization_config`, safetensors with the format's tensors;
- `dst/dequantized`: the same model with the dequantised weights in fp32 (transformers' input).
"""

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble i of an int32 holds column AWQ_ORDER[i]


def rtn_int4(weight: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of weight [rows, g] (one group per row): codes, fp16 scales, int zeros."""
    if sym:
        scales = (weight.abs().amax(-1) / 7.5).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        low, high = weight.amin(-1).clamp(max=0), weight.amax(-1).clamp(min=0)
        scales = ((high - low) / 15).half()
        zeros = torch.round(-low / scales.float()).clamp(1, 15).to(torch.int32)
    codes = torch.round(weight / scales.float()[:, None]) + zeros[:, None]
    return codes.clamp(0, 15).to(torch.int32), scales, zeros


def pack_nibbles(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [R, 8 C] -> [R, C]: nibble i (bits 4i..) of int32 c holds column 8 c + order[i]."""
    grouped = codes.view(codes.shape[0], -1, 8)
    packed = torch.zeros(grouped.shape[:2], dtype=torch.int64)
    for i, column in enumerate(order):
        packed |= grouped[..., column].to(torch.int64) << (4 * i)
    # the int32 with these bits (a set top nibble bit makes it negative)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def quantize_linear(weight: torch.Tensor, method: str, group_size: int, *, sym: bool = False,
                    order: torch.Tensor | None = None,
                    zero_offset: int = 1) -> tuple[dict, torch.Tensor]:
    """weight [out, in] -> (the format's tensors, the dequantised fp32 weight [out, in]).

    `order`: the input columns in the order they were grouped (act-order); None: as they are.
    """
    num_out, num_in = weight.shape
    group = num_in if group_size == -1 else group_size
    order = torch.arange(num_in) if order is None else order
    g_idx = torch.empty(num_in, dtype=torch.int32)
    g_idx[order] = torch.arange(num_in, dtype=torch.int32) // group
    codes_t = torch.empty(num_in, num_out, dtype=torch.int32)    # [in, out]
    num_groups = num_in // group
    scales = torch.empty(num_groups, num_out, dtype=torch.float16)
    zeros = torch.empty(num_groups, num_out, dtype=torch.int32)
    for g in range(num_groups):
        cols = order[g * group:(g + 1) * group]
        c, s, z = rtn_int4(weight[:, cols].float(), sym)          # [out, group], [out], [out]
        codes_t[cols] = c.t()
        scales[g], zeros[g] = s, z
    gi = g_idx.long()
    dequant = ((codes_t - zeros[gi]).float() * scales[gi].float()).t().contiguous()
    if method == "awq":
        tensors = {"qweight": pack_nibbles(codes_t, AWQ_ORDER),
                   "qzeros": pack_nibbles(zeros, AWQ_ORDER), "scales": scales}
    else:
        # GPTQ: qweight packed along the input dim (nibble j of row r = input row 8 r + j)
        rows = codes_t.view(num_in // 8, 8, num_out).transpose(1, 2).reshape(-1, 8)
        qweight = pack_nibbles(rows).view(num_in // 8, num_out)
        stored = (zeros - zero_offset) & 15                        # v1 stores zero - 1
        tensors = {"qweight": qweight, "qzeros": pack_nibbles(stored), "scales": scales,
                   "g_idx": g_idx}
    return tensors, dequant


INT4_LLAMA = dict(hidden_size=128, intermediate_size=256)   # every input size divides by 128


def int4_llama(tiny_llama_factory) -> str:
    """The tiny fp32 Llama the int4 tests quantize (one per session)."""
    return tiny_llama_factory("int4", **INT4_LLAMA)


def int4_checkpoint(tiny_llama_factory, tmp_path, method: str, group_size: int,
                    **kwargs) -> tuple[str, str]:
    """`write_quantized_llama` of that tiny Llama: (quantized folder, dequantized folder)."""
    return write_quantized_llama(int4_llama(tiny_llama_factory), str(tmp_path), method,
                                 group_size, **kwargs)


def write_quantized_llama(src: str, dst: str, method: str, group_size: int, *,
                          sym: bool = False, desc_act: bool = False, skip: tuple[str, ...] = (),
                          checkpoint_format: str = "gptq", seed: int = 0) -> tuple[str, str]:
    """Returns (quantized folder, dequantized folder); `skip` names modules left in fp32."""
    state = load_file(os.path.join(src, "model.safetensors"))
    quantized, dequantized = dict(state), dict(state)
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}
    for name in list(state):
        module = name.removesuffix(".weight")
        if not module.endswith(LINEARS) or any(s in module for s in skip):
            continue
        order = None
        if desc_act:
            order = orders.setdefault(_input_key(module),
                                      torch.randperm(state[name].shape[1], generator=gen))
        tensors, dequant = quantize_linear(
            state[name], method, group_size, sym=sym, order=order,
            zero_offset=0 if checkpoint_format == "gptq_v2" else 1)
        del quantized[name]
        quantized.update({f"{module}.{k}": v for k, v in tensors.items()})
        dequantized[name] = dequant
    quant_dir, dequant_dir = os.path.join(dst, "quantized"), os.path.join(dst, "dequantized")
    for folder, tensors in ((quant_dir, quantized), (dequant_dir, dequantized)):
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        for extra in ("config.json", "generation_config.json"):
            if os.path.exists(os.path.join(src, extra)):
                shutil.copy(os.path.join(src, extra), folder)
    with open(os.path.join(quant_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = _quant_config(method, group_size, sym, desc_act, skip,
                                                  checkpoint_format)
    with open(os.path.join(quant_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return quant_dir, dequant_dir


def _input_key(module: str) -> str:
    """Act-order permutes by the input's Hessian: projections of one input (q/k/v, gate/up)
    share the permutation, so a fused layer has one g_idx."""
    parent, _, proj = module.rpartition(".")
    return module if proj in ("o_proj", "down_proj") else parent


def _quant_config(method: str, group_size: int, sym: bool, desc_act: bool,
                  skip: tuple[str, ...], checkpoint_format: str) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": list(skip) or None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
            "sym": sym, "checkpoint_format": checkpoint_format, "lm_head": False}


@torch.inference_mode()
def hf_logprobs(path: str, seqs: list[list[int]]) -> list[torch.Tensor]:
    """fp32 transformers log-softmax [len - 1, vocab] of each next token of each sequence."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [torch.log_softmax(model(torch.tensor([s])).logits[0, :-1].double(), -1)
            for s in seqs]


@torch.inference_mode()
def hf_greedy(path: str, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        seq = list(ids)
        for _ in range(num_tokens):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        outs.append(seq[len(ids):])
    return outs


def prompts(vocab_size: int = 1000) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (7, 30)]


def run_llm(path: str, prompt_ids: list[list[int]], dtype: str = "bfloat16",
            num_tokens: int = 8, **kwargs) -> tuple[LLM, list[tuple[list[int], torch.Tensor]]]:
    """The engine, and per prompt its greedy tokens and the logprob of every prompt and
    generated token ([len(prompt) - 1 + num_tokens])."""
    llm = LLM(model=path, dtype=dtype, block_size=4, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    results = []
    for ids, out in zip(prompt_ids, llm.generate(prompt_ids, params)):
        comp = out.outputs[0]
        lps = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        lps += [step[tok].logprob for step, tok in zip(comp.logprobs, comp.token_ids)]
        results.append((list(comp.token_ids), torch.tensor(lps, dtype=torch.float64)))
    return llm, results


def check_against_hf(path: str, ref_path: str, dtype: str, atol: float, **kwargs) -> LLM:
    """Our run of `path` scores its tokens as transformers does on `ref_path` (fp32), within
    `atol`, and each greedy pick is transformers' best up to `atol` (a near-tie may differ);
    in fp32 the greedy tokens are transformers' own."""
    prompt_ids = prompts()
    llm, ours = run_llm(path, prompt_ids, dtype, **kwargs)
    refs = hf_logprobs(ref_path, [ids + tokens for ids, (tokens, _) in zip(prompt_ids, ours)])
    for ids, (tokens, lps), ref in zip(prompt_ids, ours, refs):
        chosen = ref.gather(1, torch.tensor(ids[1:] + tokens)[:, None])[:, 0]
        assert (lps - chosen).abs().max().item() <= atol
        best = ref[len(ids) - 1:].max(-1).values
        assert (best - chosen[len(ids) - 1:]).max().item() <= atol
    if dtype == "float32":
        assert [tokens for tokens, _ in ours] == hf_greedy(ref_path, prompt_ids, len(ours[0][0]))
    return llm


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.executor.worker.model_runner.model
