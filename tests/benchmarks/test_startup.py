"""`minivllm bench startup`: cold `minivllm generate` children, timed and measured one by one."""

import argparse
import sys

import pytest

from minivllm.benchmarks import startup
from minivllm.benchmarks.startup import REPORT_PEAK_RSS, _timed_child, add_startup_args, run_startup
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
from tests.conftest import smollm2_path

PROMPT = "The quick brown fox"


def _args(*argv: str) -> argparse.Namespace:
    return add_startup_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_each_child_reports_its_own_peak_rss_and_last_line():
    big = _timed_child(["python3", "-c", "b = bytearray(300 * 2**20); b[::4096] = b'x' * "
                        "len(b[::4096]); print('first'); print('big')" + REPORT_PEAK_RSS])
    small = _timed_child(["python3", "-c", "print('small')" + REPORT_PEAK_RSS])
    assert big["answer"] == "big" and small["answer"] == "small"
    assert big["peak_rss_bytes"] > 300 * 2**20
    assert small["peak_rss_bytes"] < 100 * 2**20   # not the largest child so far
    assert 0 < small["wall_s"] and 0 < big["wall_s"]


def test_first_output_is_timed_apart_from_the_exit():
    row = _timed_child(["python3", "-c", "import sys, time\nprint('  ', flush=True)\n"
                        "time.sleep(0.3)\nprint('first', flush=True)\ntime.sleep(0.6)\n"
                        "print('last')" + REPORT_PEAK_RSS])
    # the blank line does not count; the first word comes >= 0.6 s before the exit
    assert 0.3 <= row["first_output_s"] <= row["wall_s"] - 0.6
    assert row["answer"] == "last"


def test_a_failing_child_is_an_error_with_its_stderr():
    with pytest.raises(RuntimeError, match="failed \\(3\\).*went wrong"):
        _timed_child(["python3", "-c", "import sys; sys.stderr.write('went wrong'); sys.exit(3)"])
    with pytest.raises(RuntimeError, match="reported no peak RSS"):
        _timed_child(["python3", "-c", "print('no report')"])


def test_cold_generate_answers_as_the_offline_engine_does(tiny_checkpoint, tmp_path):
    out = tmp_path / "startup.json"
    result = run_startup(_args("--model", tiny_checkpoint, "--prompt", PROMPT, "--max-tokens",
                               "6", "--num-rounds", "2", "--output-json", str(out),
                               "--generate-args", "--no-chat-template --dtype float32 "
                               "--max-model-len 64 --num-gpu-blocks-override 16"))
    llm = LLM(model=tiny_checkpoint, dtype="float32", max_model_len=64, num_gpu_blocks_override=16)
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0),
                            use_tqdm=False)[0].outputs[0].text.strip()
    rows = result["rounds"]["minivllm"]
    assert len(rows) == 2 and expected and all(r["answer"] == expected for r in rows)
    # A fresh interpreter with torch loaded: well above 100 MiB, well below this machine's RAM.
    assert all(100 * 2**20 < r["peak_rss_bytes"] < 8 * 2**30 for r in rows)
    assert all(0 < r["first_output_s"] <= r["wall_s"] for r in rows)
    assert min(r["wall_s"] for r in rows) <= result["minivllm"]["wall_s"] <= max(
        r["wall_s"] for r in rows)
    assert out.read_text().count('"wall_s"') == 3   # the median and both rounds


def test_bad_arguments_are_clear_errors(tiny_checkpoint, monkeypatch):
    with pytest.raises(ValueError, match="--num-rounds must be at least 1"):
        run_startup(_args("--num-rounds", "0"))
    compare = _args("--model", tiny_checkpoint, "--compare", "llama.cpp")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)     # `import llama_cpp` fails
    with pytest.raises(ValueError, match="pip install llama-cpp-python"):
        run_startup(compare)
    monkeypatch.setattr(startup, "import_llama_cpp", lambda purpose: None)   # as if installed
    with pytest.raises(ValueError, match="needs a .gguf --model"):
        run_startup(compare)


@pytest.mark.skipif(smollm2_path() is None, reason="the default model is not installed")
def test_real_llama_cpp_cold_start_answers_as_many_tokens():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (pip install llama-cpp-python)")
    result = run_startup(_args("--num-rounds", "1", "--compare", "llama.cpp"))
    assert result["minivllm"]["answer"] == "The capital of France is Paris."
    assert result["llama.cpp"]["answer"] and result["llama.cpp"]["peak_rss_bytes"] > 0
