"""The `minivllm` command on the embedded default model."""

import io
import random
import subprocess
import sys

import pytest

from minivllm.entrypoints.chat import StrippedStream


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


class _Recorder(io.StringIO):
    """stdout that keeps each write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_stripped_stream_shows_the_stripped_text_as_it_arrives():
    rng = random.Random(0)
    for text in ["  \nThe capital   \nof France.  \n", "\n\n", "x", " a b ", ""]:
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(4, len(text) + 1)))
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        out = _Recorder()
        stream = StrippedStream(out)
        for i, delta in enumerate(deltas):
            stream.write(delta)
            # each visible character is out as soon as its delta came, and no trailing blank
            assert "".join(out.writes) == "".join(deltas[:i + 1]).strip()
        stream.close()
        assert out.getvalue() == text.strip() + "\n"


def test_generate_streams_its_answer(monkeypatch):
    from minivllm.entrypoints.cli import main

    out = _Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "What is the capital of France?", "--max-tokens", "12"]) == 0
    assert out.getvalue().startswith("The capital of France is Paris.")
    assert out.getvalue().endswith("\n")
    assert len([w for w in out.writes if w.strip()]) >= 5     # token by token, not one print


@pytest.mark.parametrize("command,teardown", [("generate", False), ("serve", True)])
def test_finish_skips_the_teardown_after_generate_only(command, teardown):
    code = ("import atexit\natexit.register(print, 'teardown')\n"
            "from minivllm.entrypoints.cli import finish\nprint('answer')\n"
            f"finish(3, [{command!r}])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    # the buffered answer is flushed either way; atexit handlers run only without the fast exit
    assert proc.stdout == ("answer\nteardown\n" if teardown else "answer\n")
