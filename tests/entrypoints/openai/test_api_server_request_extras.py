"""vLLM's per-request extras on completions, chat and responses: cache_salt (prefix-cache
isolation), return_tokens_as_token_ids (and --return-tokens-as-token-ids), chat echo,
add_special_tokens, documents, request_id and --enable-request-id-headers, vllm_xargs for
the server's custom logits processors, and prompt_embeds. A real server on a
tiny checkpoint whose tokenizer adds a BOS token, as Llama's does."""

import base64
import io
import json
import re

import httpx
import torch
import pytest
from tokenizers import processors

from tests.conftest import write_tiny_llama
from tests.entrypoints.openai._helpers import make_tokenizer, openai_client
from tests.entrypoints.openai.test_api_server import MESSAGES, MODEL, PROMPT, running_server

LONG = " ".join(["Once upon a time there was a cat."] * 8)   # several blocks of 16 tokens
GREEDY = dict(model=MODEL, temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def bos_checkpoint(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("bos_ckpt"))
    tokenizer = make_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
    write_tiny_llama(folder, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(bos_checkpoint):
    folder = bos_checkpoint
    with running_server(folder, {"enable_prompt_tokens_details": True,
                                 "return_tokens_as_token_ids": True,
                                 "enable_request_id_headers": True},
                        {"logits_processors": ["tests.v1.sample._logitsprocs:TargetTokenProcessor"],
                         "enable_prompt_embeds": True}) as server:
        yield server


def _post(server, route: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json={"model": MODEL, **body}, timeout=60, **kwargs)


def test_cache_salt_isolates_the_prefix_cache(server):
    def cached(route: str, body: dict) -> int:
        r = _post(server, route, {"max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        return details["cached_tokens"]
    for route, body in (("/v1/completions", {"prompt": LONG}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": LONG}]}),
                        ("/v1/responses", {"input": "Hello world. " + LONG})):
        runs = [cached(route, {**body, "cache_salt": f"{route}-{salt}"} if salt else body)
                for salt in ("s1", "s1", "s2", None, None, "s2")]
        assert runs[0] == runs[2] == runs[3] == 0, (route, runs)
        assert runs[1] >= 32 and runs[1] == runs[4] == runs[5], (route, runs)
    for route, body in (("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions", {"messages": MESSAGES}),
                        ("/v1/responses", {"input": PROMPT})):
        for salt in ("", 5):
            r = _post(server, route, {**body, "cache_salt": salt})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": 2,
                                          "cache_salt": "s1", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_tokens_as_token_ids_by_flag_and_by_request(server):
    client = openai_client(server)
    kwargs = dict(max_tokens=5, logprobs=2, **GREEDY)
    as_ids = client.completions.create(prompt=PROMPT, **{
        **kwargs, "extra_body": {"ignore_eos": True, "return_token_ids": True}})
    as_text = client.completions.create(prompt=PROMPT, **{
        **kwargs, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": False}})
    choice = as_ids.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in choice.logprobs.top_logprobs
               for k in top)
    assert not any(t.startswith("token_id:") for t in as_text.choices[0].logprobs.tokens)
    # The offsets still count the text's characters.
    assert choice.logprobs.text_offset == as_text.choices[0].logprobs.text_offset
    assert choice.logprobs.token_logprobs == as_text.choices[0].logprobs.token_logprobs
    streamed = [t for chunk in client.completions.create(prompt=PROMPT, stream=True, **kwargs)
                for t in chunk.choices[0].logprobs.tokens]
    assert streamed == choice.logprobs.tokens
    chat = client.chat.completions.create(messages=MESSAGES, max_tokens=5, logprobs=True,
                                          top_logprobs=2, **{**GREEDY, "extra_body": {
                                              "ignore_eos": True, "return_token_ids": True}})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}"
                                          for t in chat.choices[0].model_extra["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", top.token) for c in content for top in c.top_logprobs)
    assert content[0].bytes == list(content[0].token.encode())


def test_chat_echo_prepends_the_continued_message(server):
    client = openai_client(server)
    partial = [*MESSAGES, {"role": "assistant", "content": "Once upon a"}]
    kwargs = dict(messages=partial, max_tokens=6, **GREEDY)
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(**{**kwargs, "extra_body": {**cont, "ignore_eos": True}})
    echoed = client.chat.completions.create(**{**kwargs, "extra_body": {
        **cont, "echo": True, "ignore_eos": True}})
    new_text = plain.choices[0].message.content
    assert echoed.choices[0].message.content == "Once upon a" + new_text
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == \
        (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    chunks = list(client.chat.completions.create(stream=True, n=2, **{**kwargs, "extra_body": {
        **cont, "echo": True, "ignore_eos": True}}))
    for index in (0, 1):
        text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices
                       if c.index == index)
        assert text.startswith("Once upon a") and len(text) > len("Once upon a")
    assert next(c for c in chunks if c.choices[0].delta.content).choices[0].delta.content \
        == "Once upon a"   # the echo is a chunk of its own, after the role
    # A generation prompt starts an assistant turn: a user message is not echoed.
    fresh = client.chat.completions.create(messages=MESSAGES, max_tokens=4, **{
        **GREEDY, "extra_body": {"echo": True, "ignore_eos": True}})
    again = client.chat.completions.create(messages=MESSAGES, max_tokens=4, **GREEDY)
    assert fresh.choices[0].message.content == again.choices[0].message.content
    # Without one, the reply continues the last message in its role (vLLM's rule).
    user = _post(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 3, "echo": True, "add_generation_prompt": False,
        "temperature": 0.0}).json()["choices"][0]["message"]
    assert user["role"] == "user" and user["content"].startswith(MESSAGES[0]["content"])


def test_add_special_tokens_and_documents(server):
    tokenize = _post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert tokenize[0] == 1   # this tokenizer's post-processor adds <s>

    def prompt_ids(route: str, body: dict) -> list[int]:
        r = _post(server, route, {"max_tokens": 1, "return_token_ids": True, **body}).json()
        return r.get("prompt_token_ids") or r["choices"][0]["prompt_token_ids"]
    with_bos = prompt_ids("/v1/completions", {"prompt": PROMPT})
    without = prompt_ids("/v1/completions", {"prompt": PROMPT, "add_special_tokens": False})
    assert with_bos == tokenize and without == tokenize[1:]
    chat = prompt_ids("/v1/chat/completions", {"messages": MESSAGES})
    chat_bos = prompt_ids("/v1/chat/completions", {"messages": MESSAGES,
                                                   "add_special_tokens": True})
    assert chat_bos == [1, *chat]   # on top of the template's own <s>
    template = ("{% for d in documents or [] %}doc {{ d['title'] }}: {{ d['text'] }}\n"
                "{% endfor %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                "{% endfor %}")
    docs = [{"title": "fox", "text": "The quick brown fox jumps over the lazy dog."}]
    bare = prompt_ids("/v1/chat/completions", {"messages": MESSAGES, "chat_template": template})
    with_docs = prompt_ids("/v1/chat/completions", {"messages": MESSAGES, "documents": docs,
                                                    "chat_template": template})
    assert len(with_docs) > len(bare) + 8 and with_docs[-len(bare):] == bare


def test_request_id_from_the_body_or_the_header(server):
    for route, body, prefix in (("/v1/completions", {"prompt": PROMPT}, "cmpl-"),
                                ("/v1/chat/completions", {"messages": MESSAGES}, "chatcmpl-")):
        body = {**body, "max_tokens": 2}
        r = _post(server, route, {**body, "request_id": "body-id-1"})
        assert r.json()["id"] == f"{prefix}body-id-1"
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        r = _post(server, route, {**body, "request_id": "body-id-2"},
                  headers={"X-Request-Id": "header-id"})
        assert r.json()["id"] == f"{prefix}header-id" and r.headers["x-request-id"] == "header-id"
        with httpx.stream("POST", f"{server.url}{route}", timeout=60,
                          json={"model": MODEL, **body, "stream": True},
                          headers={"X-Request-Id": "streamed-id"}) as streamed:
            assert streamed.headers["x-request-id"] == "streamed-id"
            first = next(line for line in streamed.iter_lines() if line.startswith("data: {"))
        assert f'"id":"{prefix}streamed-id"' in first.replace(" ", "")
    assert _post(server, "/health", {}).headers.get("x-request-id") is not None


def test_vllm_xargs_reach_the_custom_logits_processors(server):
    client = openai_client(server)
    forced = client.completions.create(prompt=PROMPT, max_tokens=5, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "vllm_xargs": {"target_token": 7},
                                 "return_token_ids": True}})
    assert forced.choices[0].model_extra["token_ids"] == [7] * 5
    chat = client.chat.completions.create(messages=MESSAGES, max_tokens=4, n=2, **{
        **GREEDY, "temperature": 1.0, "extra_body": {"ignore_eos": True, "return_token_ids": True,
                                                     "vllm_xargs": {"target_token": 9}}})
    assert all(c.model_extra["token_ids"] == [9] * 4 for c in chat.choices)
    free = client.completions.create(prompt=PROMPT, max_tokens=5, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "return_token_ids": True}})
    assert free.choices[0].model_extra["token_ids"] != [7] * 5
    for xargs in ({"target_token": "seven"}, {"target_token": [7]}):
        r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                              "vllm_xargs": xargs})
        assert r.status_code == 400 and "target_token must be a token id" in r.text, r.text
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "vllm_xargs": {"a": {"nested": 1}}})
    assert r.status_code == 400 and "vllm_xargs" in r.text


def _b64_tensor(tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_prompt_embeds_complete_as_their_tokens(server):
    """vLLM's completions `prompt_embeds`: the tokens' own embeddings answer as the tokens do,
    beside text prompts in one request; bad tensors are 400s naming prompt_embeds."""
    ids = _post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    [embeds] = server.async_llm.engine.collective_rpc(
        lambda worker: worker.get_model().embed_input_ids(torch.tensor(ids)))
    body = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    plain = _post(server, "/v1/completions", {**body, "prompt": PROMPT}).json()
    both = _post(server, "/v1/completions", {**body, "prompt": PROMPT, "n": 1,
                                             "prompt_embeds": [_b64_tensor(embeds)]}).json()
    first, second = both["choices"]
    assert first["token_ids"] == second["token_ids"] == plain["choices"][0]["token_ids"]
    assert second["text"] == plain["choices"][0]["text"] and second["prompt_token_ids"] is None
    assert both["usage"]["prompt_tokens"] == 2 * len(ids)
    chunks = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, **body, "stream": True, "prompt_embeds": _b64_tensor(embeds)}).text
    assert plain["choices"][0]["text"] == "".join(
        json.loads(line[6:])["choices"][0]["text"] for line in chunks.splitlines()
        if line.startswith("data: {") and json.loads(line[6:])["choices"])
    hidden = embeds.shape[1]
    for bad, message in (("not base64!", "base64-encoded tensor"),
                         (_b64_tensor(torch.zeros(3, hidden + 1)), f"(num_tokens, {hidden})"),
                         (_b64_tensor({"a": 1}), "floating-point torch.Tensor")):
        r = _post(server, "/v1/completions", {"prompt_embeds": bad, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds", r.text
        assert message in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"prompt_embeds": _b64_tensor(embeds), "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = _post(server, "/v1/completions", {"max_tokens": 2})
    assert r.status_code == 400 and "Give `prompt` or `prompt_embeds`" in r.text


def test_tokenize_takes_the_chat_extras(server):
    body = {"messages": MESSAGES}
    plain = _post(server, "/tokenize", body).json()["tokens"]
    assert _post(server, "/tokenize", {**body, "add_special_tokens": True}).json()["tokens"] \
        == [1, *plain]
    chat = _post(server, "/v1/chat/completions", {**body, "max_tokens": 1,
                                                  "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == plain
    template = "{% for d in documents or [] %}{{ d['text'] }}\n{% endfor %}{{ messages[0]['content'] }}"
    docs = [{"text": "The quick brown fox"}]
    with_docs = _post(server, "/tokenize", {**body, "documents": docs,
                                            "chat_template": template}).json()["count"]
    assert with_docs > _post(server, "/tokenize", {**body, "chat_template": template}).json()["count"]
    assert _post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"][0] == 1
    assert _post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}
                 ).json()["tokens"][0] != 1


def test_chat_template_content_format(server, bos_checkpoint):
    """A template that loops over content parts: auto detects the OpenAI format (the parts
    reach it); string (the server's flag) gives it text, which it cannot read."""
    from tests.transformers_utils.test_chat_template import PARTS_TEMPLATE

    body = {"messages": [{"role": "user", "content": "Hello world"}],
            "chat_template": PARTS_TEMPLATE}
    auto = _post(server, "/tokenize", {**body, "add_generation_prompt": False}).json()
    assert _post(server, "/detokenize", {"tokens": auto["tokens"]}).json()["prompt"] == \
        "user:[Hello world]"   # (trim_blocks eats the newline after a block tag)
    with running_server(bos_checkpoint, {"chat_template_content_format": "string"}) as plain:
        text = _post(plain, "/tokenize", {**body, "add_generation_prompt": False}).json()
        assert _post(plain, "/detokenize", {"tokens": text["tokens"]}).json()["prompt"] == \
            "user:" + "[]" * len("Hello world")   # one empty part per character
