"""Draft-model speculation (vLLM's `draft_model` method) through the offline LLM: a draft of
the same vocabulary proposes greedily; the tokens are those of decoding without drafts."""

import pytest

from minivllm import LLM, SamplingParams
from tests.conftest import write_tiny_llama
from tests.entrypoints.openai._helpers import write_tiny_checkpoint
from tests.entrypoints.test_llm_spec_decode import PROMPTS, _tokens


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("draft_target")))


@pytest.fixture(scope="module")
def base(target):
    return LLM(model=target, dtype="float32", max_model_len=256, num_gpu_blocks_override=96)


def _spec_llm(target: str, draft: str, k: int = 3, **kwargs) -> LLM:
    return LLM(model=target, dtype="float32", **{"max_model_len": 256,
               "num_gpu_blocks_override": 96, **kwargs},
               speculative_config={"model": draft, "num_speculative_tokens": k})


def test_the_target_as_its_own_draft_has_every_draft_accepted(target, base):
    spec = _spec_llm(target, target, k=3)
    assert spec.llm_engine.vllm_config.speculative_config.method == "draft_model"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _tokens(spec.generate(PROMPTS, params, use_tqdm=False)) == \
        _tokens(base.generate(PROMPTS, params, use_tqdm=False))
    stats = spec.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, target):
    """The target's weights with noise: it agrees with the target often, not always."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target)
    torch.manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    folder = str(tmp_path_factory.mktemp("draft_noisy"))
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("settings", [
    dict(temperature=0),
    dict(temperature=0.8, seed=3, logprobs=1, presence_penalty=0.4),
])
def test_a_different_draft_keeps_the_targets_tokens(target, base, other_draft, settings):
    spec = _spec_llm(target, other_draft, k=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True, **settings)
    assert _tokens(spec.generate(PROMPTS, params, use_tqdm=False)) == \
        _tokens(base.generate(PROMPTS, params, use_tqdm=False))
    stats = spec.llm_engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_catching_up_proposes_what_mirroring_every_step_would(target, other_draft):
    """In decode steps the draft skips the target's inputs and catches up from what it wrote:
    the same drafts as a draft that runs every step's inputs."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    stats, outputs = [], []
    for always_mirror in (False, True):
        spec = _spec_llm(target, other_draft, k=4)
        drafter = spec.llm_engine.executor.worker.model_runner.drafter
        if always_mirror:
            drafter.written = _AlwaysMissing()   # every step looks like one of a new request
        outputs.append(_tokens(spec.generate(PROMPTS, params, use_tqdm=False)))
        stats.append(spec.llm_engine.scheduler.spec_stats)
    assert outputs[0] == outputs[1] and stats[0] == stats[1]
    assert 0 < stats[0].num_accepted_tokens < stats[0].num_draft_tokens


class _AlwaysMissing(dict):
    """A `written` map in which no request is ever found: the draft mirrors every step."""

    def __contains__(self, key) -> bool:
        return False


def test_preemption_with_a_draft_model(target, base):
    """A cache of 14 blocks of 16 for eight sequences: preempted and resumed requests, the
    draft's KV in the same blocks as the target's, lookahead slots reserved."""
    spec = _spec_llm(target, target, k=3, num_gpu_blocks_override=14, max_model_len=96)
    prompts = [PROMPTS[0] + f" {i}" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert _tokens(spec.generate(prompts, params, use_tqdm=False)) == \
        _tokens(base.generate(prompts, params, use_tqdm=False))
    assert spec.llm_engine.scheduler.num_preemptions_total > 0


def test_draft_model_errors_name_the_problem(target, tmp_path):
    small_vocab = write_tiny_llama(str(tmp_path / "small_vocab"), vocab_size=64)
    with pytest.raises(ValueError, match="vocabulary"):
        _spec_llm(target, small_vocab)
    with pytest.raises(ValueError, match="needs `model`"):
        LLM(model=target, speculative_config={"method": "draft_model",
                                              "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="runs on one rank"):
        LLM(model=target, tensor_parallel_size=2,
            speculative_config={"model": target, "num_speculative_tokens": 2})
