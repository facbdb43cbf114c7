"""The llama.cpp backend: the missing-package error, the greedy loop on a fake model, and (only where
llama-cpp-python is installed, never in CI) on the default model."""

import sys

import pytest

from minivllm.benchmarks.llama_cpp import LlamaCppModel, import_llama_cpp, peak_rss_bytes, time_llama_cpp
from tests.benchmarks._helpers import FakeLlama
from tests.conftest import smollm2_path


def test_greedy_decode_times_prompt_and_tokens_apart():
    llm = FakeLlama()
    llm.context = [1, 2]                 # a previous round's context is dropped
    r = time_llama_cpp(llm, [3, 4, 5], output_len=4)
    assert r.token_ids == [6, 7, 8, 9] and llm.context == [3, 4, 5, 6, 7, 8]
    assert llm.evals == [[3, 4, 5], [6], [7], [8]]     # the prompt in one eval, then one per token
    assert 0 < r.prefill_time <= r.total_time


def test_missing_llama_cpp_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)     # `import llama_cpp` raises ImportError
    with pytest.raises(ValueError, match=r"pip install llama-cpp-python") as err:
        import_llama_cpp("--compare llama.cpp")
    assert str(err.value).startswith("--compare llama.cpp needs")


def test_peak_rss_is_this_process():
    assert peak_rss_bytes() > 10 * 2**20


@pytest.mark.skipif(smollm2_path() is None, reason="the default model is not installed")
def test_real_llama_cpp_rounds_start_from_an_empty_cache():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (pip install llama-cpp-python)")
    model = LlamaCppModel(smollm2_path(), n_ctx=32, n_threads=1)
    try:
        assert not model.llm.model_params.use_extra_bufts      # the plain CPU buffer, no AMX repack
        first = time_llama_cpp(model, [1, 504, 3458, 314], output_len=4)
        again = time_llama_cpp(model, [1, 504, 3458, 314], output_len=4)
    finally:
        model.close()
    assert len(first.token_ids) == 4 and first.token_ids == again.token_ids
