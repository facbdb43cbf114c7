"""`minivllm bench startup`: a cold `minivllm generate` in a fresh process, wall time and peak RSS.

Each round starts a new interpreter that runs `minivllm generate PROMPT` (imports, model load,
chat template, the answer printed) and waits for it to exit; `--compare llama.cpp` alternates
with a fresh interpreter that loads the same GGUF in llama.cpp (llama-cpp-python) and answers the
same chat turn, greedy, with as many threads. Wall time to exit bounds the time to the first
token from above; peak RSS is the child's own (its VmHWM). Medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any

import numpy as np

from minivllm.benchmarks.llama_cpp import import_llama_cpp
from minivllm.config.model import default_model_path
from minivllm.transformers_utils.chat_template import chat_token_ids

DEFAULT_PROMPT = "What is the capital of France?"
_TIMEOUT_S = 600.0
_PEAK_TAG = "peak_rss_kib"
# The last statements of each child: its own VmHWM. Not wait4's ru_maxrss, which Linux carries
# over from the parent the child was forked from (this benchmark's own ~250 MB).
REPORT_PEAK_RSS = ("\nimport sys as _sys\nfor _line in open('/proc/self/status'):\n"
                   "    if _line.startswith('VmHWM:'):\n"
                   f"        _sys.stderr.write('{_PEAK_TAG} ' + _line.split()[1] + '\\n')\n")

# llama.cpp's side: llama_cpp.py loaded by its path (no torch, no minivllm), LlamaCppModel's
# loading (its plain CPU buffers), greedy until the end-of-text token or max_tokens. It gets the
# chat turn as the token ids minivllm's chat template makes (rendered in this process): the same
# prompt, not llama-cpp-python's own template handling.
_LLAMA_CPP_CHILD = """
import importlib.util, json, sys
job = json.loads(sys.argv[2])
spec = importlib.util.spec_from_file_location("_minivllm_llama_cpp_child", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
model = module.LlamaCppModel(job["model"], job["n_ctx"], job["threads"])
out = model.llm.create_completion(job["prompt_token_ids"], max_tokens=job["max_tokens"],
                                  temperature=0.0, top_k=1)
print(out["choices"][0]["text"].strip())
"""


def add_startup_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None,
                        help="the model `minivllm generate` loads (default: the embedded one)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-rounds", type=int, default=3, help="cold starts per side")
    parser.add_argument("--compare", default=None, choices=["llama.cpp"],
                        help="alternate with a cold llama.cpp run on the same GGUF file")
    parser.add_argument("--generate-args", default="",
                        help="more `minivllm generate` flags, one string (e.g. '--dtype float32')")
    parser.add_argument("--output-json", default=None, help="write the results here")
    return parser


def _timed_child(cmd: list[str]) -> dict[str, Any]:
    """Runs `cmd` (a Python child ending with `REPORT_PEAK_RSS`) to its end: wall seconds, its
    peak RSS and the last line it printed."""
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... ran past {_TIMEOUT_S:.0f} s") from None
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({done.returncode}): "
                           f"{done.stderr[-2000:]}")
    peaks = [line.split()[1] for line in done.stderr.splitlines() if line.startswith(_PEAK_TAG)]
    if not peaks:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... reported no peak RSS")
    lines = done.stdout.strip().splitlines()
    return {"wall_s": wall, "peak_rss_bytes": int(peaks[-1]) * 1024,
            "answer": lines[-1] if lines else ""}


def minivllm_cmd(args: argparse.Namespace) -> list[str]:
    """`minivllm generate` as a fresh interpreter runs it (the console script's entry point)."""
    code = ("from minivllm.entrypoints.cli import main\nrc = main()" + REPORT_PEAK_RSS +
            "_sys.exit(rc)\n")
    cmd = [sys.executable, "-c", code, "generate", args.prompt, "--max-tokens",
           str(args.max_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    return cmd + shlex.split(args.generate_args)


def llama_cpp_cmd(args: argparse.Namespace, model: str, tokenizer: Any,
                  minivllm_answer: str) -> list[str]:
    """The llama.cpp child for `model`: the chat turn minivllm answered, and as many tokens as
    minivllm's answer had (+ its end-of-text token). Greedy llama.cpp takes another path on the
    default Q4_1 file (its activations are rounded to 8 bits) and would run to max_tokens."""
    from minivllm.benchmarks import llama_cpp

    ids = chat_token_ids(tokenizer, [{"role": "user", "content": args.prompt}],
                         add_generation_prompt=True)
    num_tokens = len(tokenizer.encode(minivllm_answer, add_special_tokens=False)) + 1
    job = {"model": os.path.abspath(model), "prompt_token_ids": ids, "threads": _threads(),
           "max_tokens": min(args.max_tokens, num_tokens), "n_ctx": 2048}
    return [sys.executable, "-P", "-c", _LLAMA_CPP_CHILD + REPORT_PEAK_RSS, llama_cpp.__file__,
            json.dumps(job)]


def _threads() -> int:
    """As many threads as minivllm's kernels use by default: the cores this process may run on."""
    return len(os.sched_getaffinity(0))


def run_startup(args: argparse.Namespace) -> dict[str, Any]:
    if args.num_rounds < 1:
        raise ValueError(f"--num-rounds must be at least 1, got {args.num_rounds}.")
    model, tokenizer = args.model or default_model_path(), None
    if args.compare == "llama.cpp":
        import_llama_cpp("--compare llama.cpp")      # a clear error before any round runs
        if not model.endswith(".gguf"):
            raise ValueError(f"--compare llama.cpp needs a .gguf --model (all llama.cpp reads), "
                             f"got {model!r}.")
        from minivllm.transformers_utils.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(model)
    sides = {"minivllm": minivllm_cmd(args)}
    rounds: dict[str, list[dict[str, Any]]] = {"minivllm": []}
    if tokenizer is not None:
        rounds["llama.cpp"] = []
    for r in range(args.num_rounds):
        for name in rounds:   # alternating: drift on the host hits both sides
            rounds[name].append(_timed_child(sides[name]))
            row = rounds[name][-1]
            print(f"round {r} {name}: {row['wall_s']:.2f} s, peak RSS "
                  f"{row['peak_rss_bytes'] / 2**20:.0f} MiB: {row['answer'][:60]!r}", flush=True)
            if tokenizer is not None and "llama.cpp" not in sides:   # after minivllm's first
                sides["llama.cpp"] = llama_cpp_cmd(args, model, tokenizer, row["answer"])
    result = {name: _median(rows) for name, rows in rounds.items()}
    result["rounds"] = rounds
    _report(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"wall_s": float(np.median([r["wall_s"] for r in rows])),
            "peak_rss_bytes": int(np.median([r["peak_rss_bytes"] for r in rows])),
            "answer": rows[-1]["answer"]}


def _report(result: dict[str, Any]) -> None:
    mini = result["minivllm"]
    print(f"minivllm generate, cold: {mini['wall_s']:.2f} s to exit (median), peak RSS "
          f"{mini['peak_rss_bytes'] / 2**20:.0f} MiB")
    other = result.get("llama.cpp")
    if other is not None:
        print(f"llama.cpp, cold: {other['wall_s']:.2f} s, peak RSS "
              f"{other['peak_rss_bytes'] / 2**20:.0f} MiB; minivllm / llama.cpp: wall "
              f"{mini['wall_s'] / other['wall_s']:.2f}x, peak RSS "
              f"{mini['peak_rss_bytes'] / other['peak_rss_bytes']:.2f}x")
