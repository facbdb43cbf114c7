"""The `check-model` subcommand's flags and entry point."""

import argparse
import sys

from minivllm.config.load import LOAD_FORMATS


def add_check_model_parser(sub) -> None:
    p = sub.add_parser("check-model", help="check a model file against vLLM's contract and "
                       "against transformers; non-zero exit when a check fails")
    p.add_argument("model", help="HF checkpoint folder, .gguf file, or a config.json alone "
                   "(then --load-format dummy)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model-file", default=None,
                       help="an out-of-tree model class, path/to/file.py:ClassName")
    which.add_argument("--arch", default=None, help="a registered architecture to use instead "
                       "of the config's `architectures`")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--hf", action="store_true", help="numerics: compare every layer's output "
                   "and the greedy tokens with transformers (fp32, same weights)")
    p.add_argument("-tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int,
                   default=1, help="dry-run this many TP ranks as real processes")
    p.add_argument("-pp", "--pipeline-parallel-size", dest="pipeline_parallel_size", type=int,
                   default=1, help="dry-run this many PP stages as real processes")
    p.add_argument("--prompt", default=None, help="numerics prompt (default: a fixed one)")
    p.add_argument("--max-tokens", type=int, default=8, help="numerics: greedy tokens compared")
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    p.add_argument("--json", action="store_true", help="print the report as JSON "
                   "(schema: minivllm/entrypoints/check_model/report.py)")
    p.set_defaults(func=cmd_check_model)


def cmd_check_model(args: argparse.Namespace) -> int:
    from minivllm.entrypoints.check_model import CheckOptions, run_checks

    opts = CheckOptions(model=args.model, model_file=args.model_file, arch=args.arch,
                        load_format=args.load_format, quantization=args.quantization,
                        hf=args.hf, tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=args.pipeline_parallel_size, prompt=args.prompt,
                        max_tokens=args.max_tokens, seed=args.seed)
    report = run_checks(opts)
    print(report.to_json() if args.json else report.to_text())
    sys.stdout.flush()
    return 0 if report.ok else 1
