"""n-gram speculative decoding through the offline LLM: the tokens (and logprobs) of decoding
without drafts under every sampling setting, stop strings, structured outputs, preemption,
pipeline parallelism; and drafts really accepted and rejected along the way."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
# Repetitive prompts give the proposer matches; the random model's own loops give more.
PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the",
           "Hello world hello world hello world hello", "abc abc abc", "Café crème"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("spec_ckpt")))


def _llm(path, **kwargs) -> LLM:
    return LLM(model=path, **{"dtype": "float32", "max_model_len": 256,
                              "num_gpu_blocks_override": 96, **kwargs})


@pytest.fixture(scope="module")
def base(checkpoint):
    return _llm(checkpoint)


@pytest.fixture(scope="module")
def spec(checkpoint):
    return _llm(checkpoint, speculative_config=SPEC)


def _tokens(outputs):
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def test_greedy_decoding_is_unchanged_and_drafts_are_verified(base, spec):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    stats = spec.llm_engine.scheduler.spec_stats
    before = stats.num_draft_tokens, stats.num_accepted_tokens
    expected = base.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert 0 < accepted < drafted   # some drafts stood, some were replaced
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1]


def test_get_metrics_reports_acceptance_as_vllms_example_reads_it(spec):
    """vLLM's offline spec-decode example: Counters by name, per-position acceptances as a
    Vector; they add up to the scheduler's totals."""
    from minivllm.v1.metrics.reader import Counter, Gauge, Vector

    spec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                  use_tqdm=False)
    metrics = {m.name: m for m in spec.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(drafts, Counter) and isinstance(per_pos, Vector)
    assert drafts.value > 0 and sum(per_pos.values) == accepted.value > 0
    assert len(per_pos.values) == SPEC["num_speculative_tokens"]
    assert isinstance(metrics["vllm:num_requests_running"], Gauge)
    assert metrics["vllm:num_requests_running"].value == 0


@pytest.mark.parametrize("settings", [
    dict(temperature=0.9, seed=11, logprobs=2),
    dict(temperature=0.8, top_p=0.9, top_k=40, seed=3, repetition_penalty=1.3,
         frequency_penalty=0.3, presence_penalty=0.2),
    dict(temperature=0, min_tokens=20, stop_token_ids=[5, 6, 7], logit_bias={9: 3.0}, logprobs=1),
    dict(temperature=1.0, seed=5, n=2, min_p=0.05),
])
def test_sampling_settings_give_the_tokens_of_decoding_without_drafts(base, spec, settings):
    params = SamplingParams(max_tokens=40, ignore_eos=True, **settings)
    expected = base.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    if params.logprobs is not None:
        for e, g in zip(expected, got):
            e, g = e.outputs[0], g.outputs[0]
            assert len(g.logprobs) == len(g.token_ids)
            for step_e, step_g in zip(e.logprobs, g.logprobs):
                assert step_e.keys() == step_g.keys()
                assert all(abs(step_e[t].logprob - step_g[t].logprob) < 1e-4 for t in step_e)
            assert g.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-3)


def test_a_stop_string_inside_a_verified_step_ends_the_output_there(base, spec):
    free = base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                         use_tqdm=False)
    stops = [o.outputs[0].text[12:15] for o in free]
    params = [SamplingParams(temperature=0, max_tokens=48, stop=[s]) for s in stops]
    expected = base.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    for e, g in zip(expected, got):
        assert (g.outputs[0].text, g.outputs[0].finish_reason, g.outputs[0].stop_reason) == \
            (e.outputs[0].text, e.outputs[0].finish_reason, e.outputs[0].stop_reason)
        assert g.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(regex="(the |quick |brown |fox )+"),
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}},
                                  "required": ["a"]}),
    StructuredOutputsParams(choice=["the quick brown fox the quick brown fox", "hello"]),
])
def test_structured_outputs_mask_every_draft_position(base, spec, constraint):
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
    expected = base.generate(PROMPTS[:2], params, use_tqdm=False)
    got = spec.generate(PROMPTS[:2], params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)


def test_preemption_and_prefix_caching_keep_the_tokens(checkpoint, base):
    """Eight sequences sharing a prefix in a cache of 14 blocks of 16 tokens: requests are
    preempted (their drafts dropped) and recomputed, blocks are reused."""
    small = _llm(checkpoint, speculative_config=SPEC, num_gpu_blocks_override=14,
                 max_model_len=96)
    prompts = [PROMPTS[0] + f" {i}" for i in range(8)]
    params = SamplingParams(temperature=0.7, seed=2, max_tokens=48, ignore_eos=True)
    assert _tokens(small.generate(prompts, params, use_tqdm=False)) == \
        _tokens(base.generate(prompts, params, use_tqdm=False))
    scheduler = small.llm_engine.scheduler
    assert scheduler.num_preemptions_total > 0 and scheduler.spec_stats.num_accepted_tokens > 0


def test_hybrid_models_refuse_speculation(tmp_path, checkpoint):
    tokenizer_folder = checkpoint
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(vocab_size=256, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        layer_types=["conv", "full_attention"], max_position_embeddings=128)
    Lfm2ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="recurrent-state layers"):
        LLM(model=str(tmp_path), tokenizer=tokenizer_folder, speculative_config=SPEC)


def test_pipeline_stages_run_the_drafts_they_did_not_propose(checkpoint, base):
    """PP=2 over real processes: the first stage learns each step's drafts from the scheduler
    (only the last stage samples and proposes)."""
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.8, seed=4, max_tokens=32, ignore_eos=True)]
    piped = _llm(checkpoint, speculative_config=SPEC, pipeline_parallel_size=2)
    try:
        got = piped.generate(PROMPTS, params, use_tqdm=False)
        assert piped.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        piped.llm_engine.shutdown()
    assert _tokens(got) == _tokens(base.generate(PROMPTS, params, use_tqdm=False))


def test_default_model_copying_text_accepts_most_drafts(default_model_path):
    """The embedded SmolLM2 asked to repeat a paragraph: n-gram drafts from the prompt are
    mostly right, and the answer is the one decoding without drafts gives (fp32: its kernels
    do not depend on how many rows a step has, on any CPU)."""
    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. "
            "It is named after the engineer Gustave Eiffel, whose company designed and built "
            "the tower from 1887 to 1889.")
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]
    params = SamplingParams(temperature=0, max_tokens=32)
    outputs = []
    for spec_config in (None, {"method": "ngram", "num_speculative_tokens": 4,
                               "prompt_lookup_max": 4, "prompt_lookup_min": 2}):
        llm = LLM(model=default_model_path, dtype="float32", max_model_len=512,
                  num_gpu_blocks_override=64, speculative_config=spec_config)
        outputs.append(llm.chat(messages, params, use_tqdm=False)[0].outputs[0])
    plain, speculated = outputs
    assert speculated.token_ids == plain.token_ids and "Eiffel Tower" in plain.text
    assert llm.llm_engine.scheduler.spec_stats.mean_acceptance_length > 2.5


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_lora_requests_verify_drafts_through_their_adapter(tmp_path, method):
    """Requests with and without an adapter in one batch: drafts (from the base model, for the
    draft model) are verified by the adapted target, whose tokens they keep."""
    from minivllm.lora.request import LoRARequest
    from tests.conftest import write_tiny_llama
    from tests.lora._lora_helpers import ALL_LINEAR, write_adapter
    from tests.worker._eagle_heads import write_aligned_head, write_eagle_target

    # EAGLE: a target its aligned head guesses well (tests/worker/_eagle_heads.py)
    base = (write_eagle_target if method == "eagle" else write_tiny_llama)(str(tmp_path / "base"))
    adapter = LoRARequest("a", 1, write_adapter(base, str(tmp_path / "adapter"), 2, ALL_LINEAR))
    prompts = [{"prompt_token_ids": ids} for ids in
               ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [3, 4, 3, 4, 3, 4])]
    loras = [adapter, None, adapter]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
            "draft_model": {"model": base, "num_speculative_tokens": 3},
            "eagle": {"method": "eagle", "num_speculative_tokens": 3,
                      "model": write_aligned_head(str(tmp_path / "head"), base)}}[method]
    kwargs = dict(model=base, dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
                  enable_lora=True, max_lora_rank=8)
    expected = LLM(**kwargs).generate(prompts, params, lora_request=loras, use_tqdm=False)
    llm = LLM(**kwargs, speculative_config=spec)
    got = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
