"""`minivllm bench`: argument parsing and tiny end-to-end runs of both backends."""

import json
from pathlib import Path

import pytest

from minivllm.entrypoints.cli import build_parser, main


def test_throughput_args_defaults_and_engine_flags():
    args = build_parser().parse_args(["bench", "throughput", "--dtype", "bfloat16", "--input-len", "100",
                                      "--max-num-seqs", "32", "--compare", "--hf-max-batch-size", "8"])
    assert (args.input_len, args.output_len, args.num_prompts) == (100, 128, 64)
    assert args.random_range_ratio == 0.88
    assert (args.dtype, args.max_num_seqs, args.compare, args.hf_max_batch_size) == ("bfloat16", 32, True, 8)
    assert args.backend == "minivllm" and args.dataset_name == "random" and args.output_json is None
    alias = build_parser().parse_args(["bench", "throughput", "--random-input-len", "7"])
    assert alias.input_len == 7 and alias.hf_max_batch_size is None


def test_latency_args_and_bad_choices():
    args = build_parser().parse_args(["bench", "latency", "--backend", "hf", "--num-iters", "5"])
    assert (args.backend, args.num_iters, args.batch_size) == ("hf", 5, 1)
    assert (args.input_len, args.output_len) == (32, 128)
    for argv in (["bench", "latency", "--backend", "vllm"],
                 ["bench", "throughput", "--dataset-name", "sharegpt"], ["bench"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)


def test_throughput_compare_end_to_end(tiny_checkpoint, tmp_path, capsys):
    result = _compare(tiny_checkpoint, tmp_path / "throughput.json", "--num-prompts", "4",
                      "--input-len", "8", "--output-len", "4", "--hf-max-batch-size", "2")
    for backend in ("minivllm", "hf"):
        r = result[backend]
        assert r["num_requests"] == 4 and r["num_output_tokens"] == 16
        assert r["requests_per_second"] > 0 and r["tokens_per_second"] > 0
        assert r["output_tokens_per_second"] > 0
    assert result["output_throughput_ratio"] > 0
    assert "output tokens/s" in capsys.readouterr().out


def test_throughput_rounds_alternate_on_fresh_prompts(tiny_checkpoint, tmp_path, capsys):
    result = _compare(tiny_checkpoint, tmp_path / "rounds.json", "--rounds", "3",
                      "--num-prompts", "3", "--input-len", "6", "--output-len", "2")
    for backend in ("minivllm", "hf"):
        r = result[backend]
        assert r["num_requests"] == 9 and r["num_output_tokens"] == 18   # 3 rounds pooled
        assert len(r["output_tokens_per_second_by_round"]) == 3
    # no --hf-max-batch-size: the first round chose the size, the later ones reused it
    assert result["hf"]["hf_batch_size"] in (1, 3)
    ratios = result["output_throughput_ratios"]
    assert len(ratios) == 3 and result["output_throughput_ratio"] == sorted(ratios)[1]
    printed = capsys.readouterr().out
    assert printed.count("[round ") == 3 and "median of 3 rounds" in printed
    assert main(["bench", "throughput", "--model", tiny_checkpoint, "--rounds", "0"]) == 2
    assert "rounds must be at least 1, got 0" in capsys.readouterr().err


def test_latency_hf_end_to_end(tiny_checkpoint, tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", tiny_checkpoint, "--backend", "hf", "--input-len", "6",
                 "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["prompt_tokens_per_second"] > 0 and r["decode_tokens_per_second"] > 0


def _compare(model: str, out: Path, *args: str) -> dict:
    """`minivllm bench throughput --compare` with `args`; the JSON it wrote to `out`."""
    rc = main(["bench", "throughput", "--model", model, "--compare", *args, "--disable-tqdm",
               "--output-json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_throughput_compare_quantization_alternates_two_minivllm_runs(tiny_checkpoint, tmp_path,
                                                                      capsys):
    """--compare-quantization: the same workload with the checkpoint's weights and with online
    int8 weights, rounds alternating in one process; the ratio is this run's / that run's."""
    out = tmp_path / "quant.json"
    assert main(["bench", "throughput", "--model", tiny_checkpoint, "--compare-quantization",
                 "int8", "--rounds", "2", "--num-prompts", "3", "--input-len", "6",
                 "--output-len", "2", "--disable-tqdm", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) >= {"minivllm", "minivllm -q int8"}
    for backend in ("minivllm", "minivllm -q int8"):
        assert result[backend]["num_output_tokens"] == 12        # 2 rounds pooled
    ratios = result["output_throughput_ratios"]
    assert len(ratios) == 2 and result["output_throughput_ratio"] == sum(ratios) / 2
    printed = capsys.readouterr().out
    assert "minivllm / minivllm -q int8:" in printed and printed.count("[round ") == 2
    assert main(["bench", "throughput", "--model", tiny_checkpoint, "--compare",
                 "--compare-quantization", "none"]) == 2
    assert "cannot be combined with --compare" in capsys.readouterr().err
