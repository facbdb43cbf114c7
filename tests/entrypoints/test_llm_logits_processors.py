"""Custom logits processors end to end (vLLM's `logits_processors=` and `extra_args`): only the
requests that ask are steered, in one batch with others; per-request functions through
AdapterLogitsProcessor see the live output; argmax-invariant ones skip greedy rows; a bad
request is refused alone; TP workers build their own; what vLLM refuses is refused."""

import pytest

from minivllm import LLM, SamplingParams
from tests.entrypoints.openai._helpers import write_tiny_checkpoint
from tests.v1.sample._logitsprocs import CountingInvariantProcessor, TargetTokenProcessor

PROMPTS = ["The quick brown fox", "Hello world, how are", "Once upon a time", "A tiny model"]
TARGET = 7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("logitsprocs_ckpt")))


def _llm(checkpoint: str, **kwargs) -> LLM:
    return LLM(model=checkpoint, max_model_len=128, num_gpu_blocks_override=64, **kwargs)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return _llm(checkpoint, logits_processors=[
        TargetTokenProcessor, "tests.v1.sample._logitsprocs:NoRepeatProcessor",
        CountingInvariantProcessor])


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_only_the_asking_requests_are_steered(llm):
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = _tokens(llm.generate(PROMPTS, SamplingParams(**greedy), use_tqdm=False))
    mixed = [SamplingParams(**greedy, extra_args={"target_token": TARGET} if i % 2 else None)
             for i in range(len(PROMPTS))]
    steered = _tokens(llm.generate(PROMPTS, mixed, use_tqdm=False))
    for i, (tokens, alone) in enumerate(zip(steered, plain)):
        assert tokens == ([TARGET] * 8 if i % 2 else alone), i
    # Random sampling, a seed, and n > 1: still forced.
    sampled = llm.generate(PROMPTS[0], SamplingParams(
        temperature=1.0, seed=3, n=3, max_tokens=6, ignore_eos=True,
        extra_args={"target_token": TARGET}), use_tqdm=False)[0]
    assert all(list(c.token_ids) == [TARGET] * 6 for c in sampled.outputs)


def test_adapter_functions_see_prompt_and_live_output(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             extra_args={"no_repeat": True} if i < 2 else None)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs[:2]:
        tokens = list(out.outputs[0].token_ids)
        assert len(set(tokens)) == len(tokens) and not set(tokens) & set(out.prompt_token_ids)
    plain = llm.generate(PROMPTS[2:], SamplingParams(temperature=0.0, max_tokens=12,
                                                     ignore_eos=True), use_tqdm=False)
    assert _tokens(outs[2:]) == _tokens(plain)
    # Without the processor this tiny random model repeats itself within 12 tokens.
    repeats = [list(o.outputs[0].token_ids) for o in llm.generate(
        PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)]
    assert any(len(set(t)) < len(t) for t in repeats)


def test_argmax_invariant_processors_skip_greedy_rows(llm):
    CountingInvariantProcessor.rows_seen = 0
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert CountingInvariantProcessor.rows_seen == 0
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert CountingInvariantProcessor.rows_seen == 4 * len(PROMPTS)


def test_validate_params_refuses_one_request(llm):
    with pytest.raises(ValueError, match="target_token must be a token id"):
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2), SamplingParams(
            max_tokens=2, extra_args={"target_token": "seven"})], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=["target_token"])
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True,
                                                  extra_args={"target_token": 9}), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == [9, 9, 9]


def test_tensor_parallel_workers_build_their_own(checkpoint):
    tp = _llm(checkpoint, tensor_parallel_size=2,
              logits_processors=["tests.v1.sample._logitsprocs.TargetTokenProcessor"])
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                 extra_args={"target_token": TARGET} if i == 1 else None)
                  for i in range(2)]
        outs = _tokens(tp.generate(PROMPTS[:2], params, use_tqdm=False))
        assert outs[1] == [TARGET] * 5 and outs[0] != [TARGET] * 5
    finally:
        tp.shutdown()


def test_refused_where_vllm_refuses(checkpoint):
    with pytest.raises(ValueError, match="not supported when speculative decoding"):
        _llm(checkpoint, logits_processors=[TargetTokenProcessor],
             speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="Pooling models do not support"):
        _llm(checkpoint, logits_processors=[TargetTokenProcessor], runner="pooling",
             convert="embed")
    with pytest.raises(ValueError, match="is not a subclass"):
        _llm(checkpoint, logits_processors=["tests.v1.sample._logitsprocs:NotAProcessor"])


def test_preempted_requests_keep_their_processor_state(checkpoint):
    """Preemption drops a request from the batch and brings it back: the processor's
    per-request function keeps seeing the whole output (no token repeats)."""
    small = LLM(model=checkpoint, max_model_len=32, block_size=4, num_gpu_blocks_override=12,
                logits_processors=["tests.v1.sample._logitsprocs:NoRepeatProcessor"])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                            extra_args={"no_repeat": True})
    outs = small.generate([p[:20] for p in PROMPTS + PROMPTS[:2]], params, use_tqdm=False)
    for out in outs:
        tokens = list(out.outputs[0].token_ids)
        assert len(set(tokens)) == 20 and not set(tokens) & set(out.prompt_token_ids)
    assert next(m for m in small.get_metrics() if m.name == "vllm:num_preemptions").value > 0
