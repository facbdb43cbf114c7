"""--reasoning-parser on a real server: a scripted tiny Llama (it always writes `<think> quick
brown fox</think> the lazy dog`) answers chat completions with `reasoning` and `content` apart,
streamed or not, /v1/responses with a reasoning item, and structured outputs that begin only
once the reasoning has ended."""

from __future__ import annotations

import pytest
import torch

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import make_tokenizer, openai_client, serve

MODEL = "thinker"
MESSAGES = [{"role": "user", "content": "Hello world"}]
REASONING, CONTENT = " quick brown fox", " the lazy dog"


def write_scripted_checkpoint(folder: str, tokenizer, chain: list[int]) -> str:
    """A Llama whose greedy token after chain[i] is chain[i + 1]. Its layer's weights are zero,
    so the residual stream carries the token's embedding: the chain's tokens embed as distinct
    unit vectors, and the LM head maps each to the next token (logit 80, all others 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    assert len(set(chain[:-1])) == len(chain) - 1, "each token may lead to one next token"
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        for i, (token, following) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, i] = 1.0
            model.lm_head.weight[following, i] = 10.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokenizer = make_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])   # added, not special: they decode as text
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    words = lambda text: tokenizer.encode(text, add_special_tokens=False)   # noqa: E731
    chain = [prompt[-1], *tokenizer.convert_tokens_to_ids(["<think>"]), *words(REASONING),
             *tokenizer.convert_tokens_to_ids(["</think>"]), *words(CONTENT), 2]
    path = write_scripted_checkpoint(str(tmp_path_factory.mktemp("thinker")), tokenizer, chain)
    async_llm = AsyncLLM.from_engine_args(EngineArgs(
        model=path, dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
        reasoning_parser="qwen3"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
        app = build_app(async_llm, MODEL)
    with serve(async_llm, app) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_chat_splits_reasoning_from_content(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32,
                                       temperature=0)
    message = r.choices[0].message
    assert message.reasoning == REASONING and message.content == CONTENT
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32,
                                                 temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == REASONING and content == CONTENT


def test_responses_have_a_reasoning_item(client):
    r = client.responses.create(model=MODEL, input="Hello world", max_output_tokens=32,
                                temperature=0)
    thought, message = r.output
    assert thought.type == "reasoning" and thought.content[0].text == REASONING
    assert message.type == "message" and r.output_text == CONTENT
    events = list(client.responses.create(model=MODEL, input="Hello world", stream=True,
                                          max_output_tokens=32, temperature=0))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == REASONING
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    # The reasoning item goes back into the conversation of the next turn.
    follow = client.responses.create(model=MODEL, input="Hello world", max_output_tokens=4,
                                     previous_response_id=r.id)
    assert follow.status in ("completed", "incomplete")


def test_structured_outputs_start_after_the_reasoning(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32,
                                       temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    message = r.choices[0].message
    # The grammar left the reasoning alone, then forced one of the choices.
    assert message.reasoning == REASONING and message.content in ("yes", "no")


def test_an_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        EngineArgs(model="unused", reasoning_parser="nope").create_engine_config()


def test_anthropic_messages_carry_a_thinking_block(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL, max_tokens=32, messages=MESSAGES, extra_body={"temperature": 0})
    message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == REASONING and message.content[1].text == CONTENT
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == \
        [("thinking", REASONING), ("text", CONTENT)]
