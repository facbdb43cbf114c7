"""The packed GGUF stream meeting a layer built without the quant config: its tensor arrives
dequantised under the plain `weight` name; packed layers keep their blocks."""

import numpy as np
import torch

from minivllm.model_executor.model_loader.gguf_loader import dequantize_for_plain_layers


def _packed(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    import gguf

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)              # [rows, bytes]
    packed = torch.from_numpy(q)
    packed.gguf_type = int(gguf.GGMLQuantizationType.Q8_0)
    return packed, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)


def test_plain_layers_get_dequantised_weights_and_packed_ones_keep_blocks():
    embed, embed_ref = _packed(8, 64, seed=0)
    proj, _ = _packed(4, 64, seed=1)
    params = {"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.qweight"}
    stream = [("model.embed_tokens.qweight", embed), ("model.layers.0.mlp.down_proj.qweight", proj),
              ("model.norm.weight", torch.ones(64))]
    out = dict(dequantize_for_plain_layers(iter(stream), params))
    assert set(out) == {"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.qweight",
                        "model.norm.weight"}
    assert out["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(out["model.embed_tokens.weight"], torch.from_numpy(embed_ref))
    assert out["model.layers.0.mlp.down_proj.qweight"] is proj
    bf16 = torch.randn(4, 8).bfloat16()
    bf16.gguf_type = 30                                            # GGML BF16, already floats
    out = dict(dequantize_for_plain_layers(iter([("lm_head.qweight", bf16)]), {"lm_head.weight"}))
    assert torch.equal(out["lm_head.weight"], bf16.float())
