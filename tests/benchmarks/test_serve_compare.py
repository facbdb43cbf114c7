"""`bench serve --compare-offline`: the engine flags handed to the server, the offline loop's
concurrency limit and timings, and (slow) the whole comparison against a real server process."""

import argparse

import pytest

from minivllm.benchmarks.backends import make_engine, release
from minivllm.benchmarks.serve import add_serve_bench_args, random_prompts, run_serve_bench
from minivllm.benchmarks.serve_compare import engine_cli_flags, run_offline


def _args(*argv: str) -> argparse.Namespace:
    return add_serve_bench_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_engine_flags_are_the_non_default_ones():
    args = _args("--model", "m.gguf", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                 "--compile", "-O", '{"mode": 3}', "--compare-offline", "--num-rounds", "2")
    flags = engine_cli_flags(args)
    assert flags[:2] == ["--model", "m.gguf"]
    assert "--no-enable-prefix-caching" in flags and "--no-enforce-eager" in flags
    assert flags[flags.index("--max-num-seqs") + 1] == "8"
    assert flags[flags.index("--compilation-config") + 1] == '{"mode": 3}'
    assert "--num-rounds" not in flags and "--seed" not in flags   # bench-only / default
    assert engine_cli_flags(_args()) == []


def test_offline_round_keeps_the_concurrency_limit(tiny_checkpoint):
    args = _args("--model", tiny_checkpoint, "--max-model-len", "64",
                 "--num-gpu-blocks-override", "64")
    engine = make_engine(args)
    try:
        prompts = random_prompts(list(range(3, 200)), 4, 8, seed=0)
        num_running = []
        step = engine.step

        def counting_step():
            num_running.append(engine.get_num_unfinished_requests())
            return step()

        engine.step = counting_step
        results, duration = run_offline(engine, prompts, output_len=5, concurrency=2)
    finally:
        release(engine)
    assert max(num_running) == 2 and duration > 0
    assert [r.output_tokens for r in results] == [5] * 4 and all(r.ok for r in results)
    assert all(r.ttft_s > 0 and len(r.itl_s) == 4 and r.latency_s >= r.ttft_s for r in results)


@pytest.mark.slow
def test_compare_offline_end_to_end(tiny_checkpoint, tmp_path, capsys):
    result = run_serve_bench(_args(
        "--compare-offline", "--model", tiny_checkpoint, "--max-model-len", "64",
        "--num-gpu-blocks-override", "64", "--num-prompts", "4", "--max-concurrency", "2",
        "--input-len", "8", "--output-len", "4", "--num-rounds", "2",
        "--result-json", str(tmp_path / "r.json")))
    assert len(result["rounds"]) == 2
    for r in result["rounds"]:
        assert r["offline"]["completed"] == r["served"]["completed"] == 4
        assert r["offline"]["total_output_tokens"] == r["served"]["total_output_tokens"] == 16
        assert r["served_vs_offline_output_throughput"] > 0
        assert r["offline"]["cpu_s_per_1k_output_tokens"] > 0
        assert r["served"]["cpu_s_per_1k_output_tokens"] > 0
    out = capsys.readouterr().out
    assert "Offline engine" in out and "Served / offline output token throughput" in out
    assert result["median_offline_vs_server_cpu_per_token"] > 0
