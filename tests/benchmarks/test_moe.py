"""`minivllm bench moe` on a tiny MoE shape: both backends run, ratios and the floor are printed."""

import json

import pytest

from minivllm.benchmarks.moe_floors import (_step_macs, active_bytes_per_token, batch_macs,
                                            experts_read_per_step)
from minivllm.entrypoints.cli import build_parser, main

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-experts", "4",
        "--moe-intermediate-size", "32", "--top-k", "2", "--num-heads", "4", "--num-kv-heads", "2",
        "--head-dim", "16", "--vocab-size", "256", "--input-len", "8", "--decode-tokens", "4",
        "--num-prompts", "3", "--output-len", "4", "--rounds", "2"]


def test_moe_defaults_are_qwen3_30b_a3b_layers():
    args = build_parser().parse_args(["bench", "moe"])
    assert (args.hidden_size, args.num_experts, args.moe_intermediate_size, args.top_k) == (
        2048, 128, 768, 8)
    # Per layer: attention 2048 * 128 * (2*32 + 2*4) + top-8 experts of 3 * 768 * 2048 + router.
    per_layer = 2048 * 128 * 72 + 2 * 128 + 2 * 2048 + 8 * 3 * 768 * 2048 + 128 * 2048
    assert active_bytes_per_token(args) == 2 * (2 * per_layer + 2048 + 32768 * 2048)


def test_moe_bench_end_to_end(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", *TINY, "--dtype", "float32", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "minivllm / transformers (same run)" in printed and "bandwidth floor" in printed
    result = json.loads(out.read_text())
    for backend in ("minivllm", "hf"):
        assert result[backend]["decode_tokens_per_s"] > 0
        assert result[backend]["batch_output_tokens_per_s"] > 0
        # two alternating rounds each; the figure is the best one
        assert len(result[backend]["batch_seconds_per_round"]) == 2
        assert result[backend]["batch_seconds"] == min(result[backend]["batch_seconds_per_round"])
    assert result["ratios"]["decode"] > 0 and result["floor"]["max_decode_tokens_per_s"] > 0
    # a batch's step shares the experts its tokens route to: never below the batch-1 ceiling
    floor = result["floor"]
    assert floor["max_batch_decode_tokens_per_s"] >= floor["max_decode_tokens_per_s"]
    assert "the batch's decode steps read" in printed
    # the compute floor: the batch's multiply-adds at the measured fp32 GEMM rate
    assert floor["gemm_dtype"] == "float32" and floor["gemm_rate_gmac_per_s"] > 0
    assert floor["compute_floor_batch_seconds"] == pytest.approx(
        floor["batch_macs"] / (floor["gemm_rate_gmac_per_s"] * 1e9))
    assert floor["max_batch_tokens_per_s_compute"] == pytest.approx(
        3 * 4 / floor["compute_floor_batch_seconds"])
    assert "compute floor:" in printed and "float32 F.linear" in printed
    assert "GGUF compute floor" not in printed
    # the roofline: no step faster than its multiply-adds or its weight reads allow
    bandwidth = floor["read_bandwidth_gb_per_s"] * 1e9
    assert floor["roofline_batch_seconds"] >= floor["compute_floor_batch_seconds"] * (1 - 1e-9)
    assert floor["roofline_batch_seconds"] > 3 * floor["batch_bytes_per_step"] / bandwidth
    assert floor["max_batch_tokens_per_s_roofline"] == pytest.approx(
        12 / floor["roofline_batch_seconds"])
    assert "roofline (each step at the larger of its compute and weight-read times)" in printed


def test_batch_macs_counts_every_forward_position():
    """3 prompts of 8 tokens, 4 new each: 11 forward positions per prompt (the last new token is
    never fed back), attention over 1..11 keys, the LM head at the 4 sampled positions."""
    args = build_parser().parse_args(["bench", "moe", *TINY])
    per_token = 64 * 16 * (2 * 4 + 2 * 2) + 64 * 4 + 2 * 3 * 32 * 64   # projections, router, top-2
    attention = 2 * 4 * 16 * sum(range(1, 12))
    assert batch_macs(args) == 3 * (2 * (11 * per_token + attention) + 4 * 256 * 64)
    # the defaults (Qwen3-30B-A3B layers, 64 prompts of 32 in / 32 out): ~598 GMAC
    defaults = build_parser().parse_args(["bench", "moe"])
    assert 590e9 < batch_macs(defaults) < 605e9
    # the steps the roofline times: the prompts' (8 positions, 1 sampled), then 3 decode steps
    steps = _step_macs(args)
    assert len(steps) == 4 and sum(steps) == batch_macs(args)
    assert steps[0] == 3 * (2 * (8 * per_token + 2 * 4 * 16 * sum(range(1, 9))) + 256 * 64)
    assert steps[3] == 3 * (2 * (per_token + 2 * 4 * 16 * 11) + 256 * 64)


def test_batch_floor_counts_the_experts_a_step_reads():
    """Uniform routing: one token reads its k experts; 64 tokens over 128 experts at top-8 miss
    only ~2 of them, so the batch's steps read nearly every expert of a layer."""
    args = build_parser().parse_args(["bench", "moe"])
    assert experts_read_per_step(args, 1) == pytest.approx(args.top_k)
    assert experts_read_per_step(args, 64) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 64))
    assert 125 < experts_read_per_step(args, 64) < 127
    assert experts_read_per_step(args, 10 ** 6) == pytest.approx(args.num_experts)


def test_moe_bench_gguf_runs_the_packed_file_beside_bf16(tmp_path, capsys):
    """--gguf-type: the same weights as a qwen3moe GGUF (experts stacked, matrices in Q8_0) run
    packed in the same rounds; the ratios against bf16 and transformers and the packed floor are
    printed. (llama.cpp on that file: where llama-cpp-python is installed.)"""
    out = tmp_path / "moe.json"
    tiny = [*TINY[:TINY.index("--vocab-size")], "--vocab-size", "300",
            *TINY[TINY.index("--vocab-size") + 2:]]
    assert main(["bench", "moe", *tiny, "--gguf-type", "Q8_0", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "minivllm GGUF / minivllm bf16 (same run)" in printed
    assert "GGUF bandwidth floor" in printed
    result = json.loads(out.read_text())
    assert result["minivllm-gguf"]["batch_output_tokens_per_s"] > 0
    assert result["ratios"]["minivllm-gguf/minivllm"]["decode"] > 0
    # Q8_0 matrices: 34 bytes per 32 weights, against bf16's 2 bytes (the F32 norms and router
    # weigh a little more than their bf16 versions)
    floor = result["floor"]
    assert floor["gguf_active_bytes_per_token"] == pytest.approx(
        floor["active_bytes_per_token"] * 34 / 32 / 2, rel=0.05)
    assert floor["gguf_max_batch_decode_tokens_per_s"] > floor["gguf_max_decode_tokens_per_s"]
    # the packed compute floor takes the faster of the bf16 GEMM and the Q8_0 kernel
    assert floor["gguf_gemm_rate_gmac_per_s"] > 0
    assert floor["gguf_compute_floor_batch_seconds"] == pytest.approx(floor["batch_macs"] / (
        1e9 * max(floor["gguf_gemm_rate_gmac_per_s"], floor["gemm_rate_gmac_per_s"])))
    assert "GGUF compute floor" in printed
    assert floor["gguf_roofline_batch_seconds"] >= floor["gguf_compute_floor_batch_seconds"] * (
        1 - 1e-9)


def test_moe_bench_gguf_file_loads_as_qwen3_moe_with_packed_experts(tmp_path):
    """The written file is a Qwen3-MoE to minivllm: config from its metadata, experts packed."""
    import torch

    from minivllm import LLM
    from minivllm.benchmarks.moe import moe_config, write_checkpoint
    from minivllm.benchmarks.moe_gguf import load_state, write_moe_gguf

    args = build_parser().parse_args(["bench", "moe", *TINY[:TINY.index("--vocab-size")],
                                      "--vocab-size", "300"])
    write_checkpoint(args, str(tmp_path))
    path = write_moe_gguf(moe_config(args), load_state(str(tmp_path)),
                          str(tmp_path / "moe.gguf"), "Q4_0")
    llm = LLM(model=path, dtype="bfloat16")
    config = llm.llm_engine.vllm_config.model_config.hf_config
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.num_experts, config.moe_intermediate_size, config.vocab_size) == (4, 32, 300)
    layer = llm.llm_engine.executor.worker.model_runner.model.model.layers[1].mlp.experts
    assert layer.w13_qweight.dtype == torch.uint8 and layer.w13_qweight_type == 2   # Q4_0


def test_moe_bench_gguf_argument_errors(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "moe", "--gguf-type", "IQ2_XS"])
    assert "invalid choice: 'IQ2_XS'" in capsys.readouterr().err
    assert main(["bench", "moe", *TINY, "--compare", "llama.cpp"]) != 0
    assert "--compare llama.cpp needs --gguf-type" in capsys.readouterr().err
    from minivllm.benchmarks.moe_gguf import synthetic_vocabulary

    with pytest.raises(ValueError, match="--vocab-size must be at least 260"):
        synthetic_vocabulary(256)
    assert len(set(synthetic_vocabulary(300))) == 300


def test_moe_bench_llama_cpp_decodes_the_same_file(tmp_path):
    """--compare llama.cpp: llama.cpp loads the written qwen3moe file and decodes batch-1 in
    the same rounds (its greedy tokens on the tiny random model are not compared)."""
    pytest.importorskip("llama_cpp",
                        reason="llama-cpp-python is optional (pip install llama-cpp-python)")
    out = tmp_path / "moe.json"
    tiny = [*TINY[:TINY.index("--vocab-size")], "--vocab-size", "300",
            *TINY[TINY.index("--vocab-size") + 2:]]
    assert main(["bench", "moe", *tiny, "--gguf-type", "Q4_1", "--compare", "llama.cpp",
                 "--skip-hf", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["llama.cpp"]["decode_ms_per_round"]) == 2
    assert "batch_output_tokens_per_s" not in result["llama.cpp"]
    assert result["ratios"]["minivllm-gguf/llama.cpp"]["decode"] > 0
