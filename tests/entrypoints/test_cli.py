"""The `minivllm` command on the embedded default model."""

import subprocess
import sys


# What a cold `minivllm generate` on a GGUF model must not import (cost measured on 2 cores):
# transformers (~1 s, ~2.3 s with LlamaConfig's validators), torch._dynamo (~1.5-2 s with sympy;
# eager runs and CPU-graph captures never need it) and the server/benchmark stacks.
_HEAVY_MODULES = ("transformers", "torch._dynamo", "sympy", "fastapi", "uvicorn", "httpx",
                  "minivllm.benchmarks", "minivllm.entrypoints.openai")
_GENERATE = """import sys
from minivllm.entrypoints.cli import main
rc = main(["generate", "What is the capital of France?", "--max-tokens", "24"])
print("HEAVY:", ",".join(m for m in {heavy!r} if m in sys.modules))
sys.exit(rc)
"""


def test_generate_answers_paris_without_heavy_imports():
    proc = subprocess.run([sys.executable, "-c", _GENERATE.format(heavy=_HEAVY_MODULES)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    answer, heavy = proc.stdout.rsplit("HEAVY:", 1)
    assert "Paris" in answer
    assert heavy.strip() == ""


def test_bad_flag_value_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", "generate", "hi",
                           "--temperature", "-1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "temperature" in proc.stderr


def test_torchrun_environment_reaches_node_0s_engine(monkeypatch):
    # torchrun on node 0 of 2: node 0 is not headless, and the engine its command builds from
    # `args` must see the job's world (nnodes, master address/port), not the flag defaults.
    from minivllm.entrypoints.cli import _headless_engine_args, build_parser

    for name, value in {"MASTER_ADDR": "127.0.0.9", "MASTER_PORT": "29400", "GROUP_RANK": "0",
                        "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job"}.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["generate", "hi", "-tp", "2"])
    assert _headless_engine_args(args) is None
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == \
        (2, 0, "127.0.0.9", 29401)
    monkeypatch.setenv("GROUP_RANK", "1")
    node1 = build_parser().parse_args(["serve", "some/model", "-tp", "2"])
    headless = _headless_engine_args(node1)
    assert headless is not None and (headless.node_rank, headless.model) == (1, "some/model")
