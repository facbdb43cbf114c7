"""llama.cpp (llama-cpp-python, optional) as a latency-benchmark backend: greedy batch-1 decode, peak RSS.

NOTE: this module imports nothing of minivllm and no torch: `llama_cpp_peak_rss` loads it by its
file path in a fresh interpreter, so that the child's peak RSS is llama.cpp's alone.
"""

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

INSTALL_HINT = "pip install llama-cpp-python"


@dataclass
class LlamaCppRound:
    prefill_time: float    # start -> the first generated token (prompt eval + its argmax)
    total_time: float      # start -> the last generated token
    token_ids: list[int]   # the generated tokens, greedy


def import_llama_cpp(purpose: str) -> Any:
    """The `llama_cpp` module, or a ValueError saying how to install it (never a traceback)."""
    try:
        import llama_cpp
    except ImportError as err:
        raise ValueError(f"{purpose} needs llama.cpp's Python binding, llama-cpp-python, which "
                         f"does not import here ({err}). Install it with `{INSTALL_HINT}` (or "
                         "`pip install 'minivllm[bench]'`); it builds llama.cpp from source, which "
                         "takes several minutes.") from None
    return llama_cpp


class LlamaCppModel:
    """A GGUF file in llama.cpp (llama-cpp-python's `Llama`) on the CPU, `n_threads` for both
    prompt and decode, driven one `eval` at a time; greedy sampling reads the logits in place."""

    def __init__(self, model_path: str, n_ctx: int, n_threads: int) -> None:
        self.llama_cpp = import_llama_cpp("--compare llama.cpp")
        with _without_extra_buffer_types(self.llama_cpp):
            self.llm = self.llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads,
                                            n_threads_batch=n_threads, logits_all=False,
                                            verbose=False)
        assert not self.llm.model_params.use_extra_bufts
        self.n_vocab = self.llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()     # n_tokens = 0: the next eval drops the KV cache from position 0

    def eval(self, token_ids: list[int]) -> None:
        self.llm.eval(token_ids)

    def greedy_token(self) -> int:
        """Argmax of the last evaluated position's logits: temperature 0, top-k 1."""
        # [n_vocab] view of llama.cpp's own logits buffer (with logits_all=False, eval keeps no copy)
        logits = np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1),
                                       shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def close(self) -> None:
        self.llm.close()


def time_llama_cpp(model: LlamaCppModel, prompt_token_ids: list[int], output_len: int) -> LlamaCppRound:
    """Greedy decode of `output_len` tokens after `prompt_token_ids`, from an empty KV cache."""
    model.reset()
    start = time.perf_counter()
    model.eval(prompt_token_ids)
    token_ids = [model.greedy_token()]
    first_token_at = time.perf_counter()
    # NOTE: a Python loop over tokens is what a batch-1 decode is: each step needs the last token.
    while len(token_ids) < output_len:
        model.eval(token_ids[-1:])
        token_ids.append(model.greedy_token())
    return LlamaCppRound(first_token_at - start, time.perf_counter() - start, token_ids)


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024     # reported in kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def llama_cpp_peak_rss(model_path: str, prompt_token_ids: list[int], output_len: int, n_ctx: int,
                       n_threads: int, timeout_s: float = 600.0) -> int:
    """Peak RSS in bytes of a fresh interpreter that loads llama.cpp and runs one greedy decode."""
    job = {"model_path": os.path.abspath(model_path), "prompt_token_ids": prompt_token_ids,
           "output_len": output_len, "n_ctx": n_ctx, "n_threads": n_threads}
    # -P: no cwd on sys.path, where a folder could shadow `llama_cpp`
    done = subprocess.run([sys.executable, "-P", "-c", _CHILD, __file__, json.dumps(job)],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the llama.cpp peak-RSS child failed ({done.returncode}): "
                           f"{done.stderr[-2000:]}")
    return int(done.stdout.strip().splitlines()[-1])


def run_child(job: dict) -> int:
    """The child's work: load, one decode, then its peak RSS."""
    model = LlamaCppModel(job["model_path"], job["n_ctx"], job["n_threads"])
    time_llama_cpp(model, job["prompt_token_ids"], job["output_len"])
    return peak_rss_bytes()


# Loads this file as a plain module (not through the minivllm package, which imports torch).
_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("_minivllm_llama_cpp_child", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(module.run_child(json.loads(sys.argv[2])))
"""


@contextlib.contextmanager
def _without_extra_buffer_types(llama_cpp: Any) -> Iterator[None]:
    """Loads with model_params.use_extra_bufts = False: the weights stay in llama.cpp's plain CPU
    buffer (its AVX-512 kernels), as `llama-cli --no-repack` does.

    NOTE: the AMX repack buffer llama.cpp picks on Sapphire Rapids segfaults on Q4_1. Llama()
    (0.3.36) has no such argument and silently drops unknown ones, so the default model params it
    starts from are patched while it loads.
    """
    low_level = llama_cpp.llama_cpp
    if "use_extra_bufts" not in dict(low_level.llama_model_params._fields_):
        raise NotImplementedError("this llama-cpp-python has no llama_model_params.use_extra_bufts; "
                                  f"version {llama_cpp.__version__} is not supported")
    original = low_level.llama_model_default_params

    def default_params() -> Any:
        params = original()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = default_params
    try:
        yield
    finally:
        low_level.llama_model_default_params = original
