"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) matches transformers on the same file."""

import pytest
import torch

from minivllm import LLM, SamplingParams

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain what a CPU does in one sentence."]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(model=default_model_path, dtype="float32")


@torch.inference_mode()
def test_greedy_chat_tokens_match_transformers(llm, hf_default_model):
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    for ids, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == _hf_greedy(hf_default_model, ids)


def _hf_greedy(model, ids: list[int]) -> list[int]:
    """Plain greedy decoding that, like ignore_eos, keeps going past EOS without masking it."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(NUM_TOKENS - 1):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_default_model_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"
