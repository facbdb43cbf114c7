"""vLLM 0.33.0's own llama_eagle.py and llama_eagle3.py (the EAGLE heads' files) driven by
minivllm's proposer: the same drafts as minivllm's files for the same heads, every step, and
the target's tokens (the files come from vLLM's source distribution, see `_vllm_files`)."""

import pytest

from minivllm import LLM, SamplingParams
from tests.worker._eagle_heads import (write_aligned_head, write_eagle3_head,
                                       write_eagle_target)

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "abc abc abc"]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_eagle_target(str(tmp_path_factory.mktemp("vllm_eagle_target")))


def _drafts_and_tokens(target: str, head: str, method: str) -> tuple[list, list, type]:
    llm = LLM(model=target, dtype="float32", max_model_len=128, max_num_batched_tokens=16,
              speculative_config={"method": method, "model": head, "num_speculative_tokens": 3})
    drafter = llm.llm_engine.executor.worker.model_runner.drafter
    record, propose = [], drafter.propose

    def recording(inputs, features, states, sample_ids):
        drafts = propose(inputs, features, states, sample_ids)
        record.extend(drafts)
        return drafts

    drafter.propose = recording
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS,
                                                                 use_tqdm=False)]
    return record, tokens, type(drafter.model)


@pytest.mark.parametrize("file, arch, method", [
    ("llama_eagle", "EagleLlamaForCausalLM", "eagle"),
    ("llama_eagle3", "LlamaForCausalLMEagle3", "eagle3"),
])
def test_vllm_eagle_files_draft_as_minivllms(target, tmp_path, registered_vllm_class, file,
                                             arch, method):
    head = (write_aligned_head(str(tmp_path / "head"), target) if method == "eagle" else
            write_eagle3_head(str(tmp_path / "head"), target, draft_vocab=120))
    ours, our_tokens, our_cls = _drafts_and_tokens(target, head, method)
    cls = registered_vllm_class(file, arch, "Eagle3LlamaForCausalLM" if method == "eagle3"
                                else None)
    theirs, their_tokens, their_cls = _drafts_and_tokens(target, head, method)
    assert their_cls is cls and f"._checked_{file}_" in cls.__module__
    assert our_cls.__module__ == f"minivllm.model_executor.models.{file}"
    assert len(ours) > 10 and any(ours)
    assert theirs == ours and their_tokens == our_tokens
