"""`minivllm bench latency`: --compare's choices, --compare llama.cpp without llama.cpp, and
--background-load."""

import json
import os
import sys
import time

import pytest

from minivllm.benchmarks import latency
from minivllm.benchmarks.latency import background_load, check_latency_args
from minivllm.entrypoints.cli import build_parser, main
from tests.benchmarks._helpers import FakeLlama


def _parse(*argv: str):
    return build_parser().parse_args(["bench", "latency", *argv])


def test_compare_takes_an_optional_backend():
    assert _parse().compare is None
    assert _parse("--compare").compare == "hf"           # as before: transformers
    args = _parse("--compare", "llama.cpp", "--dtype", "bfloat16", "--num-iters", "2")
    assert (args.compare, args.dtype, args.num_iters) == ("llama.cpp", "bfloat16", 2)
    with pytest.raises(SystemExit):
        _parse("--compare", "vllm")


@pytest.mark.parametrize("compare, rounds", [(None, 3), ("hf", 3), ("llama.cpp", 5)])
def test_num_iters_default_depends_on_compare(compare, rounds):
    args = _parse(*(["--compare", compare] if compare else []))
    check_latency_args(args)
    assert args.num_iters == rounds


def test_missing_llama_cpp_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)     # `import llama_cpp` raises ImportError
    assert main(["bench", "latency", "--compare", "llama.cpp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --compare llama.cpp needs") and "pip install llama-cpp-python" in err
    assert "Traceback" not in err


def test_compare_llama_cpp_rounds_with_a_fake_llama(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    # llama.cpp, the GGUF check, the 1 GiB bandwidth pass and the child processes are faked; the
    # rounds, the minivllm side, the summary and the printed lines are real.
    monkeypatch.setattr(latency, "import_llama_cpp", lambda purpose: None)
    monkeypatch.setattr(latency, "is_gguf", lambda model: True)
    monkeypatch.setattr(latency, "LlamaCppModel", lambda path, n_ctx, n_threads: FakeLlama(300))
    floor = {"weight_bytes_per_step": 1e6, "read_bandwidth_gb_per_s": 10.0, "floor_ms_per_step": 0.1,
             "max_decode_tokens_per_second": 1e4, "torch_num_threads": 1}
    monkeypatch.setattr(latency, "bandwidth_floor", lambda model: floor)
    monkeypatch.setattr(latency, "_peak_rss", lambda *a: {"minivllm_bytes": 3 * 2**20,
                                                          "llama.cpp_bytes": 2**20, "ratio": 3.0})
    out = tmp_path / "vs_llama.json"
    assert main(["bench", "latency", "--model", tiny_checkpoint, "--compare", "llama.cpp",
                 "--input-len", "5", "--output-len", "4", "--num-iters", "2",
                 "--num-iters-warmup", "1", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    for backend in ("minivllm", "llama.cpp"):
        assert len(r[backend]["decode_tokens_per_second_by_round"]) == 2
        assert r[backend]["decode_tokens_per_second_median"] > 0
    assert len(r["decode_ratios"]) == 2 and r["decode_ratio"] > 0
    assert len(r["greedy_agreement"]) == 2 and all(0 <= n <= 4 for n in r["greedy_agreement"])
    assert r["bandwidth_floor"] == floor and r["peak_rss"]["ratio"] == 3.0
    printed = capsys.readouterr().out
    assert printed.count("[round ") == 2 and "minivllm / llama.cpp (median of 2" in printed
    assert "Bandwidth floor: 1.0 MB" in printed and "llama.cpp 1 MiB (3.00x)" in printed


def _children() -> set[int]:
    """Pids of this process's live children (Linux: /proc/<pid>/task/<tid>/children)."""
    pids: set[int] = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            pids.update(int(p) for p in f.read().split())
    return pids


def test_background_load_runs_busy_processes_only_inside_the_block():
    before = _children()
    with background_load(2):
        busy = _children() - before
        assert len(busy) == 2
        time.sleep(0.3)
        for pid in busy:   # they spin: CPU time accrues (utime, field 14 of /proc/<pid>/stat)
            with open(f"/proc/{pid}/stat") as f:
                assert int(f.read().rsplit(")", 1)[1].split()[11]) > 0
    assert not (_children() - before)


def test_background_load_end_to_end(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "loaded.json"
    assert main(["bench", "latency", "--model", tiny_checkpoint, "--input-len", "6",
                 "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0",
                 "--background-load", "1", "--output-json", str(out)]) == 0
    assert "[load] 1 busy process(es)" in capsys.readouterr().out
    assert json.loads(out.read_text())["background_load"] == 1
    assert main(["bench", "latency", "--model", tiny_checkpoint, "--background-load", "-1"]) == 2
    assert "background_load must be at least 0, got -1" in capsys.readouterr().err
