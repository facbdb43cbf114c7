"""The offline LLM's inputs: prompts as text, token ids or vLLM's TextPrompt / TokensPrompt,
OpenAI-style chat messages (text parts), and a ValueError naming what is wrong for anything else,
with the engine still serving afterwards."""

import numpy as np
import pytest

from minivllm import LLM, SamplingParams, TextPrompt, TokensPrompt
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("inputs_ckpt")))
    return LLM(model=path, max_model_len=128, num_gpu_blocks_override=64)


def _tokens(llm, prompt, params=GREEDY) -> list[int]:
    return list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)


def test_prompt_forms_agree(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    expected = _tokens(llm, PROMPT)
    assert _tokens(llm, TextPrompt(prompt=PROMPT)) == expected
    assert _tokens(llm, TokensPrompt(prompt_token_ids=ids)) == expected
    assert _tokens(llm, ids) == expected
    assert _tokens(llm, [np.int64(t) for t in ids]) == expected   # numpy ids count as ints


@pytest.mark.parametrize("prompt, message", [
    (5, "prompts must be a string, a list of token ids, a prompt dict, or a list of these; "
        "got int"),
    ({"prompt": 5}, "A prompt dict's 'prompt' must be a string, got int"),
    ({"prompt_token_ids": "1 2"}, "'prompt_token_ids' must be a list of token ids (ints), got str"),
    ({"prompt_token_ids": [1, 2.5]}, "must be a list of token ids"),
    ({"text": "x"}, "A prompt dict needs 'prompt', 'prompt_token_ids' or 'prompt_embeds'"),
    ([[1, 2], 3.5], "Unsupported prompt type float"),
])
def test_bad_prompts_name_the_valid_forms(llm, prompt, message):
    with pytest.raises(ValueError) as info:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert message in str(info.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampling_params_of_the_wrong_type(llm):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list "
                                         "with one per prompt, got dict"):
        llm.generate(PROMPT, {"temperature": 0}, use_tqdm=False)


def test_chat_takes_openai_text_parts_and_refuses_bad_messages(llm):
    plain = [{"role": "user", "content": "Hello world"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello world"}]}]
    assert llm.apply_chat_template(parts) == llm.apply_chat_template(plain)
    params = GREEDY
    both = llm.chat([parts, plain], params, use_tqdm=False)
    alone = llm.chat(plain, params, use_tqdm=False)[0]
    assert [list(o.outputs[0].token_ids) for o in both] == [list(alone.outputs[0].token_ids)] * 2
    for messages, message in [
        ("Hello", "messages must be a list of message dicts, got str"),
        ([{"content": "no role"}], "messages[0] needs a string `role`"),
        ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content parts"),
    ]:
        with pytest.raises(ValueError) as info:
            llm.chat(messages, params, use_tqdm=False)
        assert message in str(info.value)
    with pytest.raises(ValueError, match="The chat template failed on these messages: no"):
        llm.chat(plain, params, use_tqdm=False, chat_template="{{ raise_exception('no') }}")
    assert _tokens(llm, PROMPT) == _tokens(llm, PROMPT)   # still serving


THINK_TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                  "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def test_chat_template_kwargs_continue_final_message_and_lora_argument(llm):
    tokenizer = llm.get_tokenizer()
    user = [{"role": "user", "content": "Hello world"}]
    text = tokenizer.decode(llm.apply_chat_template(
        user, chat_template=THINK_TEMPLATE, chat_template_kwargs={"enable_thinking": False}))
    assert text.startswith("/no_think user: Hello world")
    assert "/no_think" not in tokenizer.decode(llm.apply_chat_template(
        user, chat_template=THINK_TEMPLATE))
    # the last message continued: the template's text after its content is cut (transformers)
    partial = user + [{"role": "assistant", "content": "The quick"}]
    ids = llm.apply_chat_template(partial, add_generation_prompt=False,
                                  continue_final_message=True)
    assert tokenizer.decode(ids).endswith("assistant: The quick")
    out = llm.chat(partial, GREEDY, add_generation_prompt=False, continue_final_message=True,
                   lora_request=None, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    for kwargs, message in [
        (dict(continue_final_message=True), "cannot both be true"),
        (dict(chat_template_kwargs={"add_generation_prompt": False}),
         "chat_template_kwargs may not set add_generation_prompt"),
        (dict(chat_template_kwargs="x"), "chat_template_kwargs must be a dict"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.chat(partial, GREEDY, use_tqdm=False, **kwargs)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.get_tokenizer().encode(PROMPT * 40)[:150]        # longer than max_model_len=128
    with pytest.raises(ValueError, match="more than max_model_len=128"):
        llm.generate(TokensPrompt(prompt_token_ids=ids), GREEDY, use_tqdm=False)
    kept = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=20)
    out = llm.generate(TokensPrompt(prompt_token_ids=ids), kept, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-20:]
    assert list(out.outputs[0].token_ids) == _tokens(llm, ids[-20:])
    whole = SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=-1)
    assert llm.generate(ids, whole, use_tqdm=False)[0].prompt_token_ids == ids[-128:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_cache_salt_keeps_prefixes_apart(llm):
    """vLLM's `cache_salt` on a prompt dict: the prefix cache serves a prompt only the blocks
    cached under the same salt; the tokens do not depend on the salt."""
    ids = llm.get_tokenizer().encode(" ".join([PROMPT] * 12))   # several blocks of 16 tokens

    def run(prompt) -> tuple[int, list[int]]:
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        return out.num_cached_tokens, list(out.outputs[0].token_ids)
    assert llm.reset_prefix_cache()   # vLLM's: nothing cached from the tests before
    cached, expected = zip(*[run(p) for p in (
        TokensPrompt(prompt_token_ids=ids), TokensPrompt(prompt_token_ids=ids, cache_salt="a"),
        {"prompt_token_ids": ids, "cache_salt": "a"}, TokensPrompt(prompt_token_ids=ids,
                                                                  cache_salt="b"),
        TokensPrompt(prompt_token_ids=ids))])
    full = len(ids) // 16 * 16
    assert list(cached) == [0, 0, full, 0, full] and len(set(map(tuple, expected))) == 1
    text = llm.tokenizer.decode(ids)
    assert run(TextPrompt(prompt=text, cache_salt="c"))[0] == 0
    assert run(TextPrompt(prompt=text, cache_salt="c"))[0] == full
    for bad in ("", 5):
        with pytest.raises(ValueError, match="'cache_salt' must be a non-empty string"):
            llm.generate({"prompt_token_ids": ids, "cache_salt": bad}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_template_content_format(llm):
    from tests.transformers_utils.test_chat_template import PARTS_TEMPLATE

    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                             {"type": "text", "text": "world"}]}]

    def prompt(fmt: str) -> str:
        out = llm.chat(messages, GREEDY, chat_template=PARTS_TEMPLATE, use_tqdm=False,
                       add_generation_prompt=False, chat_template_content_format=fmt)[0]
        return llm.get_tokenizer().decode(out.prompt_token_ids)
    assert prompt("auto") == prompt("openai") == "user:[Hello][world]"
    assert prompt("string") == "user:" + "[]" * len("Hello\nworld")
    with pytest.raises(ValueError, match="auto, string, openai"):
        prompt("parts")
