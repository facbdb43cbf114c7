"""A Q4_K_M-shaped GGUF (Q4_K matrices and embedding, Q6_K ffn_down and LM head, as llama-quantize
mixes them; Q5_0 / Q3_K / Q2_K variants too) served packed: its decode steps run the K-quants'
int8 kernels (on AVX-512 VNNI CPUs without AMX, the x8 layout of `csrc/gguf_x8_k.h`), and the
logprobs of the generated tokens agree with transformers on the same file (fp32, dequantised).

gguf-py cannot write K-quants, so the matrices are random valid blocks (random quant and scale
bytes, small positive fp16 super-block scales): both engines read the same bytes."""

import os

import gguf
import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model_executor.kernels import gguf_linear as gl
from minivllm.model_executor.kernels.gguf_dequant import K_SCALE_OFFSETS
from tests.conftest import TINY_LLAMA, make_bpe_tokenizer
from tests.model_executor.layers.quantization._gguf_helpers import (_add_metadata,
                                                                    hf_logits_of_gguf, write_out)

pytestmark = pytest.mark.requires_native
T = gguf.GGMLQuantizationType
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64, 128, 11]
# magnitude of each fp16 scale field (d, then dmin; |w| ~ 0.01-0.05): a min's is the scale's
# times the mean quant, so that the weights centre on zero as a trained model's do (weights all
# of one sign made the two engines' roundings grow to 0.7 in a logprob)
_SCALES = {T.Q2_K: (1e-3, 1.5e-3), T.Q3_K: (4e-4,), T.Q4_K: (2e-4, 1.5e-3),
           T.Q5_K: (1e-4, 1.55e-3), T.Q6_K: (5e-5,), T.Q5_0: (4e-3,)}
_OFFSETS = {**{T[name]: at for name, at in K_SCALE_OFFSETS.items()}, T.Q5_0: (0,)}
# (every other matrix, ffn_down and the LM head): llama.cpp's mixes
MIXES = {"Q4_K_M": (T.Q4_K, T.Q6_K), "Q3_K_M": (T.Q3_K, T.Q5_K), "Q2_K": (T.Q2_K, T.Q3_K),
         "Q5_0": (T.Q5_0, T.Q6_K)}


def _random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    factor = np.abs(rng.standard_normal(raw.shape[:2])) + 0.25      # one per block
    for at, scale in zip(_OFFSETS[qtype], _SCALES[qtype]):
        half = (factor * scale).astype(np.float16)
        raw[..., at:at + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_k_gguf(folder: str, main, down) -> str:
    """A 2-layer Llama (hidden 256: one K super-block per row) as a GGUF of random blocks."""
    # random words: the trainer reaches its full 512 tokens (whole 16-row groups for the head)
    words = np.random.default_rng(1).integers(97, 123, (3000, 5)).astype(np.uint8)
    tokenizer = make_bpe_tokenizer([" ".join(w.tobytes().decode() for w in words)], 512)
    assert len(tokenizer) == 512
    config = {**TINY_LLAMA, "vocab_size": len(tokenizer), "hidden_size": 256,
              "intermediate_size": 512}
    path = os.path.join(folder, f"tiny-{main.name}-{down.name}.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    _add_metadata(writer, config, tokenizer)
    rng = np.random.default_rng(0)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    shapes = {"token_embd": (v, h, main), "output": (v, h, down), "output_norm": (h,)}
    for layer in range(config["num_hidden_layers"]):
        shapes |= {f"blk.{layer}.{name}": shape for name, shape in (
            ("attn_q", (h, h, main)), ("attn_k", (kv, h, main)), ("attn_v", (kv, h, main)),
            ("attn_output", (h, h, main)), ("ffn_gate", (i, h, main)), ("ffn_up", (i, h, main)),
            ("ffn_down", (h, i, down)), ("attn_norm", (h,)), ("ffn_norm", (h,)))}
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(f"{name}.weight", np.ones(shape, np.float32))
            continue
        q = _random_blocks(shape[2], shape[0], shape[1], rng)
        writer.add_tensor(f"{name}.weight", q, raw_shape=q.shape, raw_dtype=shape[2])
    write_out(writer)
    return path


@pytest.mark.parametrize("mix", list(MIXES))
def test_k_quant_file_decodes_as_transformers(tmp_path, mix):
    main, down = MIXES[mix]
    path = write_k_gguf(str(tmp_path), main, down)
    llm = LLM(model=path, dtype="bfloat16", max_num_batched_tokens=256)
    model = llm.llm_engine.executor.worker.model_runner.model
    qkv, head = model.model.layers[0].self_attn.qkv_proj, model.lm_head
    assert qkv.qweight_type == main and head.qweight_type == down    # packed, not dequantised
    for layer, qtype in ((qkv, main), (head, down)):
        # the x8 layout exactly where this CPU's kernels read the type (VNNI: all of these)
        x8 = bool(layer.qweight_kernel_type & gl.GGUF_X8_LAYOUT)
        assert x8 == (int(qtype) in gl.gguf_x8_types())
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    second = [5, 300, 77, 19]
    outs = llm.generate([PROMPT, second], params)        # decode steps of two rows
    for prompt, out in zip((PROMPT, second), outs):
        tokens = list(out.outputs[0].token_ids)
        ours = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
        ref = torch.log_softmax(hf_logits_of_gguf(path, prompt + tokens).double(), -1)
        ref = ref[len(prompt) - 1:-1]                      # [8, V]: each generated position
        picked = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        # bf16 activations (and their int8 blocks) against fp32: measured up to 0.14 over the
        # four mixes, the same with the file layout's kernels (MINIVLLM_GGUF_X8=0); a wiring or
        # layout error moves logprobs by whole units. A greedy token is transformers' own
        # choice up to that rounding (random weights have near ties: gaps up to 0.16 seen).
        assert (ours.double() - picked).abs().max().item() < 0.3
        assert (ref.max(-1).values - picked).max().item() < 0.3
