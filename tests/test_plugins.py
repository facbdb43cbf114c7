"""General plugins: entry points of `minivllm.general_plugins`, run once in every process."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import minivllm.plugins as plugins
from tests.conftest import write_tiny_llama

EXAMPLE = Path(__file__).parent.parent / "examples" / "my_llama.py"


def _fake_distribution(folder: Path, module: str, body: str, names: tuple[str, ...]) -> None:
    """An installed-looking distribution (dist-info with entry points) on `folder`."""
    (folder / f"{module}.py").write_text(textwrap.dedent(body))
    info = folder / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[minivllm.general_plugins]\n" + "".join(f"{n} = {module}:{n}\n" for n in names))


@pytest.fixture
def fake_plugin(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "fake_minivllm_plugin", """
        CALLS = []

        def first():
            CALLS.append("first")

        def second():
            CALLS.append("second")
    """, ("first", "second"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    import importlib

    module = importlib.import_module("fake_minivllm_plugin")
    yield module
    sys.modules.pop("fake_minivllm_plugin", None)


def test_general_plugins_run_once_per_process(fake_plugin):
    plugins.load_general_plugins()
    plugins.load_general_plugins()
    assert sorted(fake_plugin.CALLS) == ["first", "second"]


def test_vllm_plugins_selects_by_name(fake_plugin, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "second")
    assert list(plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)) == ["second"]
    plugins.load_general_plugins()
    assert fake_plugin.CALLS == ["second"]


def test_engine_args_load_plugins_before_resolving(fake_plugin, tmp_path):
    from minivllm.engine.arg_utils import EngineArgs

    EngineArgs(model=write_tiny_llama(str(tmp_path / "tiny"))).create_engine_config()
    assert sorted(fake_plugin.CALLS) == ["first", "second"]


_PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "minivllm-test-plugin"
version = "0.1"

[project.entry-points."minivllm.general_plugins"]
my_llama = "minivllm_test_plugin:register"

[tool.setuptools]
packages = ["minivllm_test_plugin"]
"""
_REGISTER = """
def register():
    from minivllm import ModelRegistry

    # The lazy string form: the module is imported only when the architecture is resolved.
    ModelRegistry.register_model("MyLlamaForCausalLM", "minivllm_test_plugin.my_llama:MyLlamaForCausalLM")
"""
_RUN_TP2_PP2 = """
import json, sys
from minivllm import LLM, SamplingParams
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
for parallel in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
    llm = LLM(sys.argv[1], dtype="float32", block_size=4, num_gpu_blocks_override=128,
              max_model_len=128, **parallel)
    out = llm.generate([[5, 17, 42, 99, 3]], params, use_tqdm=False)
    print("TOKENS", json.dumps(list(out[0].outputs[0].token_ids)))
    llm.shutdown()
"""


@pytest.mark.slow
def test_pip_installed_plugin_model_runs_with_tp2_and_pp2(tmp_path):
    """A plugin package pip-installed into this venv registers MyLlamaForCausalLM; a fresh
    process runs it on two TP ranks, then two PP stages (each rank loads the plugin itself)."""
    pkg = tmp_path / "plugin"
    (pkg / "minivllm_test_plugin").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(_PYPROJECT)
    (pkg / "minivllm_test_plugin" / "__init__.py").write_text(_REGISTER)
    shutil.copy(EXAMPLE, pkg / "minivllm_test_plugin" / "my_llama.py")
    ckpt = write_tiny_llama(str(tmp_path / "ckpt"), architectures=["MyLlamaForCausalLM"])
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "--no-index",
                    str(pkg)], check=True, capture_output=True, timeout=300)
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-c", _RUN_TP2_PP2, ckpt], capture_output=True,
                              text=True, timeout=600, env=env)
    finally:
        subprocess.run([*pip, "uninstall", "-y", "minivllm-test-plugin"], capture_output=True,
                       timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2, pp2 = (json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                if line.startswith("TOKENS "))
    # The same weights under the in-tree Llama, one process: the same greedy tokens.
    from minivllm import LLM, SamplingParams

    ref = LLM(write_tiny_llama(str(tmp_path / "ref")), dtype="float32", block_size=4,
              num_gpu_blocks_override=128, max_model_len=128)
    out = ref.generate([[5, 17, 42, 99, 3]], SamplingParams(temperature=0, max_tokens=6,
                                                            ignore_eos=True), use_tqdm=False)
    assert tp2 == pp2 == list(out[0].outputs[0].token_ids)
