"""`minivllm bench startup`: a cold `minivllm generate` in a fresh process, wall time and peak RSS.

Each round starts a new interpreter that runs `minivllm generate PROMPT` (imports, model load,
chat template, the answer printed) and waits for it to exit; `--compare llama.cpp` alternates
with a fresh interpreter that loads the same GGUF in llama.cpp (llama-cpp-python) and answers the
same chat turn, greedy, with as many threads. Both stream their answer to stdout, so the time
to the first printed character is the time to the first token; the time to exit is measured
too. Peak RSS is the child's own (its VmHWM). Medians over the rounds. minivllm's modules are
byte-compiled first (`precompile_bytecode`), as in an installed package.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import selectors
import shlex
import subprocess
import sys
import tempfile
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
text = ""
for chunk in model.llm.create_completion(job["prompt_token_ids"], max_tokens=job["max_tokens"],
                                         temperature=0.0, top_k=1, stream=True):
    piece = chunk["choices"][0]["text"]
    if text.strip() or piece.strip():
        sys.stdout.write(piece if text.strip() else piece.lstrip())
        sys.stdout.flush()
    text += piece
print()
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
    """Runs `cmd` (a Python child ending with `REPORT_PEAK_RSS`) to its end: wall seconds to
    its first printed character (the answer's first token, as both sides stream it) and to its
    exit, its peak RSS and the last line it printed."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:   # a file: a full stderr pipe would block the child
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        out, first = _read_until_exit(proc, start, " ".join(cmd[:4]))
        wall = time.perf_counter() - start
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}): "
                           f"{stderr[-2000:]}")
    peaks = [line.split()[1] for line in stderr.splitlines() if line.startswith(_PEAK_TAG)]
    if not peaks:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... reported no peak RSS")
    lines = out.decode(errors="replace").strip().splitlines()
    return {"wall_s": wall, "first_output_s": wall if first is None else first,
            "peak_rss_bytes": int(peaks[-1]) * 1024, "answer": lines[-1] if lines else ""}


def _read_until_exit(proc: subprocess.Popen, start: float, name: str) -> tuple[bytes, float | None]:
    """The child's whole stdout, and the seconds from `start` to its first non-blank byte;
    killed (an error) past _TIMEOUT_S."""
    chunks: list[bytes] = []
    first = None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = _TIMEOUT_S - (time.perf_counter() - start)
            if left <= 0 or not sel.select(timeout=left):
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{name} ... ran past {_TIMEOUT_S:.0f} s")
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:
                break
            if first is None and data.strip():
                first = time.perf_counter() - start
            chunks.append(data)
    proc.stdout.close()
    proc.wait()
    return b"".join(chunks), first


def minivllm_cmd(args: argparse.Namespace) -> list[str]:
    """`minivllm generate` as a fresh interpreter runs it (the console script's `main` and
    `finish`, with the peak RSS reported between them)."""
    code = ("from minivllm.entrypoints.cli import finish, main\nimport sys\nrc = main()" +
            REPORT_PEAK_RSS + "finish(rc, sys.argv[1:])\n")
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
    print(f"minivllm's bytecode: {precompile_bytecode()}", flush=True)
    sides = {"minivllm": minivllm_cmd(args)}
    rounds: dict[str, list[dict[str, Any]]] = {"minivllm": []}
    if tokenizer is not None:
        rounds["llama.cpp"] = []
    for r in range(args.num_rounds):
        for name in rounds:   # alternating: drift on the host hits both sides
            rounds[name].append(_timed_child(sides[name]))
            row = rounds[name][-1]
            print(f"round {r} {name}: first token {row['first_output_s']:.2f} s, exit "
                  f"{row['wall_s']:.2f} s, peak RSS "
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


def precompile_bytecode() -> str:
    """Writes the .pyc files of minivllm's modules where they are missing, as `pip install`
    does for an installed package: with PYTHONDONTWRITEBYTECODE set (as on the CI hosts), an
    editable checkout would otherwise compile every module from source at each start (~1 s
    on 2 cores), which no installed copy does. Returns what it did, for the report."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.access(package, os.W_OK):
        return f"not written ({package} is read-only)"
    ok = compileall.compile_dir(package, quiet=2)
    return "precompiled, as an installed package has it" if ok else "precompiling failed"


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"wall_s": float(np.median([r["wall_s"] for r in rows])),
            "first_output_s": float(np.median([r["first_output_s"] for r in rows])),
            "peak_rss_bytes": int(np.median([r["peak_rss_bytes"] for r in rows])),
            "answer": rows[-1]["answer"]}


def _report(result: dict[str, Any]) -> None:
    mini = result["minivllm"]
    print(f"minivllm generate, cold: first token {mini['first_output_s']:.2f} s, exit "
          f"{mini['wall_s']:.2f} s (medians), peak RSS {mini['peak_rss_bytes'] / 2**20:.0f} MiB")
    other = result.get("llama.cpp")
    if other is not None:
        print(f"llama.cpp, cold: first token {other['first_output_s']:.2f} s, exit "
              f"{other['wall_s']:.2f} s, peak RSS {other['peak_rss_bytes'] / 2**20:.0f} MiB; "
              f"minivllm / llama.cpp: first token "
              f"{mini['first_output_s'] / other['first_output_s']:.2f}x, exit "
              f"{mini['wall_s'] / other['wall_s']:.2f}x, peak RSS "
              f"{mini['peak_rss_bytes'] / other['peak_rss_bytes']:.2f}x")
