"""The `minivllm` command on the embedded default model."""

import subprocess
import sys


def test_generate_answers_paris():
    proc = subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", "generate",
                           "What is the capital of France?", "--max-tokens", "24"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_bad_flag_value_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", "generate", "hi",
                           "--temperature", "-1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "temperature" in proc.stderr
