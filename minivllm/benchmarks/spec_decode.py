"""`minivllm bench spec-decode`: chat prompts answered with and without speculative decoding.

Batch 1 (where speculation pays: a step's weights are read once for several tokens), greedy,
both engines loaded in one process and their rounds alternating (a drifting host favours
neither). Two tasks: `copy` asks to repeat or lightly edit a given text (n-gram drafts from the
prompt are mostly right), `free` asks open questions (few drafts, so it shows the cost of
trying). Reports decode tok/s of each engine and their ratio, the drafts' mean acceptance
length, and whether the two engines' greedy tokens agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams

_PARAGRAPH = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
              "France. It is named after the engineer Gustave Eiffel, whose company designed and "
              "built the tower from 1887 to 1889. Locally nicknamed La dame de fer, it was "
              "constructed as the centerpiece of the 1889 World's Fair, and to crown the "
              "centennial anniversary of the French Revolution.")
_CODE = ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
         "    return total / len(values)\n")
TASKS = {
    "copy": [f"Repeat the following text exactly, word for word:\n\n{_PARAGRAPH}",
             f"Rewrite this text, replacing 'tower' with 'monument':\n\n{_PARAGRAPH}",
             f"Add a docstring to this Python function and return the whole function:\n\n{_CODE}"],
    "free": ["What are three good habits for staying healthy?",
             "Write a short poem about the sea."],
}
DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4,
                              "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def add_spec_decode_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--task", default="all", choices=[*TASKS, "all"])
    parser.add_argument("--output-len", type=int, default=128,
                        help="most tokens per answer (an answer may end earlier, at eos)")
    parser.add_argument("--num-rounds", type=int, default=3,
                        help="rounds of every prompt on both engines (the first is a warm-up)")
    parser.add_argument("--output-json", default=None, help="write the results to this JSON file")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(speculative_config=None)
    return parser


def run_spec_decode(args: argparse.Namespace) -> dict:
    """Both engines on every task's prompts; prints and returns the per-task results."""
    if args.num_rounds < 2 or args.output_len < 2:
        raise ValueError("--num-rounds needs at least 2 (one warm-up) and --output-len at "
                         f"least 2; got {args.num_rounds} and {args.output_len}")
    engine_args = EngineArgs.from_cli_args(args)
    spec_config = engine_args.speculative_config or DEFAULT_SPECULATIVE_CONFIG
    engines = {
        "plain": LLMEngine.from_engine_args(
            dataclasses.replace(engine_args, speculative_config=None)),
        "speculative": LLMEngine.from_engine_args(
            dataclasses.replace(engine_args, speculative_config=spec_config))}
    tasks = list(TASKS) if args.task == "all" else [args.task]
    try:
        results = {task: _run_task(engines, TASKS[task], args) for task in tasks}
    finally:
        for engine in engines.values():
            engine.shutdown()
    results = {"speculative_config": spec_config, "tasks": results}
    for task, r in results["tasks"].items():
        print(f"[{task}] plain {r['plain_decode_tok_s']:.1f} tok/s, speculative "
              f"{r['speculative_decode_tok_s']:.1f} tok/s: {r['speedup']:.2f}x; mean "
              f"acceptance length {r['mean_acceptance_length']:.2f}; greedy tokens agree on "
              f"{r['agreeing_prompts']}/{r['num_prompts']} prompts")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def _run_task(engines: dict[str, LLMEngine], prompts: list[str], args: argparse.Namespace) -> dict:
    tokenizer = engines["plain"].tokenizer
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                         add_generation_prompt=True) for p in prompts]
    ids = [list(getattr(x, "input_ids", x)) for x in ids]   # a list, or a BatchEncoding
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    stats = engines["speculative"].scheduler.spec_stats
    rates: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {name: [] for name in engines}
    drafts_before = accepted_before = 0
    for round_index in range(args.num_rounds):
        if round_index == 1:   # after the warm-up round
            drafts_before, accepted_before = stats.num_drafts, stats.num_accepted_tokens
        order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
        for name in order:
            for i, prompt_ids in enumerate(ids):
                rate, out = _time_one(engines[name], prompt_ids, params, f"{round_index}-{i}")
                if round_index:
                    rates[name].append(rate)
                if round_index == args.num_rounds - 1:
                    tokens[name].append(out)
    num_drafts = stats.num_drafts - drafts_before
    plain, spec = statistics.median(rates["plain"]), statistics.median(rates["speculative"])
    return {"num_prompts": len(ids), "plain_decode_tok_s": plain,
            "speculative_decode_tok_s": spec, "speedup": spec / plain,
            "mean_acceptance_length": (1 + (stats.num_accepted_tokens - accepted_before)
                                       / num_drafts) if num_drafts else 1.0,
            "agreeing_prompts": sum(a == b for a, b in zip(tokens["plain"],
                                                           tokens["speculative"]))}


def _time_one(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams,
              request_id: str) -> tuple[float, list[int]]:
    """Decode tok/s of one request (tokens after the first / time after the first) and its ids."""
    first: list[float] = []

    def on_output(output) -> None:
        if not first and output.outputs[0].token_ids:
            first.append(time.perf_counter())

    engine.add_request(request_id, prompt_ids, params)
    (output,) = engine.run_until_finished([request_id], on_output)
    end = time.perf_counter()
    token_ids = list(output.outputs[0].token_ids)
    return (len(token_ids) - 1) / max(end - first[0], 1e-9), token_ids
