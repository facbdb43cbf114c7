"""`minivllm bench moe` on a tiny MoE shape: both backends run, ratios and the floor are printed."""

import json

import pytest

from minivllm.benchmarks.moe import active_bytes_per_token, experts_read_per_step
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


def test_batch_floor_counts_the_experts_a_step_reads():
    """Uniform routing: one token reads its k experts; 64 tokens over 128 experts at top-8 miss
    only ~2 of them, so the batch's steps read nearly every expert of a layer."""
    args = build_parser().parse_args(["bench", "moe"])
    assert experts_read_per_step(args, 1) == pytest.approx(args.top_k)
    assert experts_read_per_step(args, 64) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 64))
    assert 125 < experts_read_per_step(args, 64) < 127
    assert experts_read_per_step(args, 10 ** 6) == pytest.approx(args.num_experts)
