"""EAGLE / EAGLE-3 speculation (vLLM's `eagle` / `eagle3` methods) through the offline LLM:
every draft is what the head computes from scratch over the known tokens (transformers'
modules, tests/worker/_eagle_heads.py), whatever the step layout (chunked prompts, verify steps
with accepted and rejected drafts, preemption); the tokens are the target's own."""

import pytest

from minivllm import LLM, SamplingParams
from tests.entrypoints.openai._helpers import write_tiny_checkpoint
from tests.worker._eagle_heads import (ReferenceDrafter, write_aligned_head, write_eagle3_head,
                                      write_eagle_head, write_eagle_target)

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the "
           "lazy dog, and then the quick brown fox rests under the old tree by the river",
           "Hello world hello", "abc abc abc", "Café crème"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_eagle_target(str(tmp_path_factory.mktemp("eagle_target")))


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_heads")
    return {"eagle": write_eagle_head(str(root / "eagle"), target),
            "eagle3": write_eagle3_head(str(root / "eagle3"), target, draft_vocab=100),
            "aligned": write_aligned_head(str(root / "aligned"), target)}


@pytest.fixture(scope="module")
def base(target):
    return LLM(model=target, dtype="float32", max_model_len=256, num_gpu_blocks_override=96)


def _spec_llm(target: str, head: str, method: str, k: int = 3, **kwargs) -> LLM:
    return LLM(model=target, dtype="float32", **{"max_model_len": 256,
               "num_gpu_blocks_override": 96, **kwargs},
               speculative_config={"method": method, "model": head,
                                   "num_speculative_tokens": k})


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def _record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(known tokens, drafts) of every proposal the engine's head makes from now on."""
    drafter = llm.llm_engine.executor.worker.model_runner.drafter
    record, propose = [], drafter.propose

    def recording(inputs, features, states, sample_ids):
        drafts = propose(inputs, features, states, sample_ids)
        record.extend((list(states[r].token_ids), d) for r, d in zip(sample_ids, drafts))
        return drafts

    drafter.propose = recording
    return record


@pytest.mark.parametrize("head, method", [("eagle", "eagle"), ("eagle3", "eagle3"),
                                          ("aligned", "eagle")])
def test_drafts_are_the_heads_and_tokens_the_targets(target, heads, base, head, method):
    """Chunked prompts (a budget of 32 tokens), and verify steps that accept some drafts."""
    spec = _spec_llm(target, heads[head], method, k=3, max_num_batched_tokens=32)
    record = _record_proposals(spec)
    assert _tokens(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == \
        _tokens(base.generate(PROMPTS, GREEDY, use_tqdm=False))
    reference = ReferenceDrafter(target, heads[head])
    checked = record[::3]
    assert len(checked) > 15
    for known, drafts in checked:
        assert drafts == reference.drafts(known, len(drafts)), f"after {len(known)} tokens"
    stats = spec.llm_engine.scheduler.spec_stats
    if head == "aligned":     # verify steps that keep 1, 2 and 3 drafts all occur
        assert 0.15 * stats.num_draft_tokens < stats.num_accepted_tokens < stats.num_draft_tokens
        assert min(stats.num_accepted_tokens_per_pos) > 0


def test_eagle3_head_on_a_qwen3_target(tmp_path):
    """Qwen3 targets (vLLM's EAGLE-3 heads for Qwen3 are Llama-architecture heads): the aux
    streams come from Qwen3's layers (q/k norms and all); drafts equal the reference's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.model_executor.models._family_helpers import write_tiny_checkpoint

    target = write_tiny_checkpoint(tmp_path / "qwen3", Qwen3Config, Qwen3ForCausalLM,
                                   num_hidden_layers=4, head_dim=16)
    head = write_eagle3_head(str(tmp_path / "head"), target, draft_vocab=300)
    spec = _spec_llm(target, head, "eagle3", k=3, max_num_batched_tokens=16)
    record = _record_proposals(spec)
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(3)]
    base = LLM(model=target, dtype="float32", max_model_len=256, num_gpu_blocks_override=96)
    assert _tokens(spec.generate(prompts, GREEDY, use_tqdm=False)) == \
        _tokens(base.generate(prompts, GREEDY, use_tqdm=False))
    reference = ReferenceDrafter(target, head)
    assert len(record) > 10
    for known, drafts in record[::4]:
        assert drafts == reference.drafts(known, len(drafts))


def test_sampled_tokens_keep_their_distribution_settings(target, heads, base):
    """Seeded sampling with penalties and logprobs: the tokens of decoding without drafts."""
    spec = _spec_llm(target, heads["aligned"], "eagle", k=4)
    params = SamplingParams(temperature=0.8, seed=3, logprobs=1, presence_penalty=0.4,
                            max_tokens=32, ignore_eos=True)
    assert _tokens(spec.generate(PROMPTS, params, use_tqdm=False)) == \
        _tokens(base.generate(PROMPTS, params, use_tqdm=False))
    assert spec.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_structured_outputs_with_eagle_drafts(target, heads, base):
    """Drafts a grammar refuses are cut before the target verifies them."""
    from minivllm.sampling_params import StructuredOutputsParams

    spec = _spec_llm(target, heads["aligned"], "eagle", k=3)
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=
                            StructuredOutputsParams(regex="(the |quick |brown |fox )+"))
    got = spec.generate(PROMPTS[:2], params, use_tqdm=False)
    assert _tokens(got) == _tokens(base.generate(PROMPTS[:2], params, use_tqdm=False))
    assert all(o.outputs[0].text.startswith(("the", "quick", "brown", "fox")) for o in got)


def test_preemption_and_prefix_caching_with_eagle(target, heads, base):
    """14 blocks of 16 for eight sequences: requests are preempted and resume (the head's
    cache rebuilt with the target's); the shared prompt's blocks come from the prefix cache."""
    spec = _spec_llm(target, heads["aligned"], "eagle", k=3, num_gpu_blocks_override=14,
                     max_model_len=96)
    record = _record_proposals(spec)
    prompts = [PROMPTS[0][:60] + f" {i}" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _tokens(spec.generate(prompts, params, use_tqdm=False)) == \
        _tokens(base.generate(prompts, params, use_tqdm=False))
    assert spec.llm_engine.scheduler.num_preemptions_total > 0
    assert spec.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    reference = ReferenceDrafter(target, heads["aligned"])
    # A cached block's last position was written knowing the next token of the request that
    # filled it; with these prompts that token is the same for every request (block 0 ends
    # inside the shared text), so the drafts still equal the from-scratch ones.
    for known, drafts in record[::7]:
        assert drafts == reference.drafts(known, len(drafts))


def test_tensor_parallel_heads_draft_as_one_rank(target, heads):
    """TP=2: the head's layers are sharded like the target's; every rank drafts the same, and
    the drafts (their acceptance at each position) and tokens are those of one rank."""
    runs = []
    for tp in (1, 2):
        llm = _spec_llm(target, heads["aligned"], "eagle", k=3, tensor_parallel_size=tp)
        tokens = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        stats = llm.llm_engine.scheduler.spec_stats
        runs.append((tokens, stats.num_draft_tokens, stats.num_accepted_tokens_per_pos))
        llm.shutdown()
    assert runs[0] == runs[1] and sum(runs[0][2]) > 0


def test_eagle_heads_share_the_targets_missing_parts(target, heads, tmp_path):
    """Without embed_tokens (and, for EAGLE, without lm_head) the head uses the target's; a
    head with its own embedding keeps it."""
    llm = _spec_llm(target, heads["eagle"], "eagle")
    runner = llm.llm_engine.executor.worker.model_runner
    head = runner.drafter.model
    assert head.model.embed_tokens is runner.model.model.embed_tokens
    assert head.lm_head is runner.model.lm_head
    own = write_eagle_head(str(tmp_path / "own_embed"), target, with_embed=True)
    llm = _spec_llm(target, own, "eagle")
    runner = llm.llm_engine.executor.worker.model_runner
    assert runner.drafter.model.model.embed_tokens is not runner.model.model.embed_tokens
    assert runner.drafter.model.has_own_embed_tokens


def test_eagle_method_follows_the_heads_name(target, heads, tmp_path):
    """vLLM's guess from `model` alone: "EAGLE-..." is EAGLE, "...eagle3..." EAGLE-3."""
    import shutil

    named = shutil.copytree(heads["eagle3"], tmp_path / "EAGLE3-tiny")
    llm = LLM(model=target, dtype="float32", max_model_len=128,
              speculative_config={"model": str(named), "num_speculative_tokens": 2})
    spec = llm.llm_engine.vllm_config.speculative_config
    assert spec.method == "eagle3"
    assert spec.draft_model_config.architectures == ["LlamaForCausalLMEagle3"]


def test_eagle_errors_name_the_problem(target, heads, tmp_path):
    with pytest.raises(ValueError, match="'eagle' needs `model`: the EAGLE head"):
        LLM(model=target, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="runs without pipeline stages"):
        LLM(model=target, pipeline_parallel_size=2,
            speculative_config={"method": "eagle", "model": heads["eagle"],
                                "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="parallel_drafting is not supported"):
        LLM(model=target, speculative_config={"method": "eagle3", "model": heads["eagle3"],
                                              "num_speculative_tokens": 2,
                                              "parallel_drafting": True})
    wide = write_tiny_checkpoint(str(tmp_path / "wide"), hidden_size=96, num_hidden_layers=4)
    with pytest.raises(ValueError, match="reads hidden states of size 64, the target's are 96"):
        LLM(model=wide, speculative_config={"method": "eagle", "model": heads["eagle"],
                                            "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt embeddings"):
        LLM(model=target, enable_prompt_embeds=True,
            speculative_config={"method": "eagle", "model": heads["eagle"],
                                "num_speculative_tokens": 2})
