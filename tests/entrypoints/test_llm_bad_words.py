"""bad_words through the offline LLM on a tiny checkpoint with a real (byte-level BPE) tokenizer:
a banned one-token word never appears, a banned two-token word is cut after its first token."""

import pytest

from minivllm import LLM, SamplingParams
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

NUM_TOKENS = 24
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("bad_words_ckpt")))
    return LLM(model=path, max_model_len=128, num_gpu_blocks_override=64)


def _greedy(llm, bad_words=None) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            bad_words=bad_words)
    return list(llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids)


def _sequences(llm, word: str) -> list[list[int]]:
    params = SamplingParams(bad_words=[word])
    params.update_from_tokenizer(llm.get_tokenizer())
    return params.bad_words_token_ids


def _find_word(llm, tokens: list[int], length: int) -> tuple[int, str]:
    """The first position whose `length` tokens are one of their own decoded text's sequences."""
    tokenizer = llm.get_tokenizer()
    for i in range(len(tokens) - length):
        word = tokenizer.decode(tokens[i:i + length]).strip()
        if word and tokens[i:i + length] in _sequences(llm, word):
            return i, word
    pytest.skip(f"no {length}-token word in the greedy output {tokens}")


def test_one_token_word_is_never_generated(llm):
    free = _greedy(llm)
    _, word = _find_word(llm, free, 1)
    banned = {ids[0] for ids in _sequences(llm, word)}
    constrained = _greedy(llm, [word])
    assert banned & set(free) and not banned & set(constrained)


def test_two_token_word_is_cut_after_its_first_token(llm):
    free = _greedy(llm)
    i, word = _find_word(llm, free, 2)
    constrained = _greedy(llm, [word])
    sequences = [ids for ids in _sequences(llm, word) if len(ids) == 2]
    # Greedy output is unchanged up to the word's first token, which stays allowed ...
    assert constrained[:i + 1] == free[:i + 1]
    # ... and no pair of consecutive output tokens is the word any more.
    pairs = {tuple(constrained[j:j + 2]) for j in range(len(constrained) - 1)}
    assert constrained[i + 1] != free[i + 1]
    assert not pairs & {tuple(s) for s in sequences}
