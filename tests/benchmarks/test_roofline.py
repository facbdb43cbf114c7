"""The bandwidth floor: GGUF weight bytes per decode step over a read bandwidth."""

import pytest
from gguf import GGUFReader

from minivllm.benchmarks.roofline import bandwidth_floor, decode_weight_bytes, measure_read_bandwidth
from tests.benchmarks._helpers import write_tiny_gguf
from tests.conftest import smollm2_path


@pytest.mark.skipif(smollm2_path() is None, reason="the default model is not installed")
def test_floor_of_the_default_model():
    path = smollm2_path()
    weight_bytes = decode_weight_bytes(path)
    # every tensor's bytes as GGUFReader sizes them (its tied embedding, Q8_0, counted once):
    # 210 Q4_1 matrices, 61 F32 norms, the 49152 x 576 embedding
    assert weight_bytes == 96_576_768
    floor = bandwidth_floor(path, bandwidth=10e9)
    assert floor["weight_bytes_per_step"] == weight_bytes
    assert floor["floor_ms_per_step"] == pytest.approx(weight_bytes / 10e9 * 1e3)
    assert floor["max_decode_tokens_per_second"] == pytest.approx(10e9 / weight_bytes)
    assert floor["read_bandwidth_gb_per_s"] == pytest.approx(10.0)


def test_an_untied_embedding_is_only_gathered(tmp_path):
    tied = write_tiny_gguf(str(tmp_path / "tied.gguf"))
    untied = write_tiny_gguf(str(tmp_path / "untied.gguf"), untied=True)
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(untied).tensors}
    assert decode_weight_bytes(tied) == sum(sizes.values()) - sizes["output.weight"]
    assert decode_weight_bytes(untied) == sum(sizes.values()) - sizes["token_embd.weight"]


def test_measured_bandwidth_is_positive():
    # bytes/s; a loose bound: the host may be busy
    assert measure_read_bandwidth(num_bytes=1 << 22, repeats=2) > 1e6


@pytest.mark.parametrize("type_name", ["Q4_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_S", "Q6_K"])
def test_packed_rate_of_legacy_types_and_k_quant_mixes(type_name):
    # `bench moe --gguf-type Q4_K_M` once crashed here: a mix is timed on its main type, on
    # random blocks whose super-block scales are finite
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from minivllm.benchmarks.roofline import measure_gguf_gemm_rate, random_gguf_blocks

    qtype = GGMLQuantizationType[type_name.removesuffix("_M").removesuffix("_S")]
    blocks = random_gguf_blocks(qtype, 8, 512)
    values = quants.dequantize(blocks.numpy(), qtype)
    assert values.shape == (8, 512) and np.isfinite(values).all() and values.std() > 0
    assert measure_gguf_gemm_rate(type_name, m=4, n=64, k=512, repeats=1) > 0
