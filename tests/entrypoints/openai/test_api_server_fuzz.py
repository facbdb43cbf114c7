"""Malformed and edge-case requests against a real server (tiny checkpoint): every field of the
completions and chat bodies given values of the wrong type or at the edges, alone and in seeded
random pairs, streamed or not, plus /tokenize, /detokenize and bodies that are no JSON object.
No answer may be a 5xx, the stream may carry no internal error, and the server stays healthy.
(A first run of this kind found TypeErrors from structured_outputs and tools, unreadable LoRA
files, and a reset keep-alive connection after a 500.)"""

import json
import random

import httpx
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import ServerThread, write_tiny_checkpoint

MODEL = "tiny"
WEIRD = [None, True, -1, 0, 2, -2**63 - 1, 2**64, 1e308, 0.5, "", "x", "\u0000", [], [1], ["a"],
         [[1, 2]], [None], {}, {"a": 1}, {"type": "text"}, [-1], [10**9], [0.5], 4096, 3.0]
COMMON = ["model", "max_tokens", "n", "temperature", "top_p", "stop", "seed", "stream",
          "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "user",
          "response_format", "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
          "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
          "structured_outputs", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
          "use_beam_search", "length_penalty", "prompt_logprobs", "return_token_ids",
          "priority"]
ENDPOINTS = {
    "/v1/completions": ({"prompt": "The quick brown fox", "max_tokens": 3},
                        COMMON + ["prompt", "logprobs", "echo", "suffix", "best_of"]),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hello world"}],
                              "max_tokens": 3},
                             COMMON + ["messages", "max_completion_tokens", "logprobs",
                                       "top_logprobs", "add_generation_prompt", "chat_template",
                                       "tools", "tool_choice", "parallel_tool_calls",
                                       "continue_final_message", "chat_template_kwargs"]),
    "/v1/responses": ({"input": "Hello world", "max_output_tokens": 3},
                      ["model", "input", "instructions", "max_output_tokens", "temperature",
                       "top_p", "top_logprobs", "include", "stream", "store", "background",
                       "previous_response_id", "tools", "tool_choice", "parallel_tool_calls",
                       "text", "metadata", "user", "truncation", "reasoning", "service_tier",
                       "top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos",
                       "structured_outputs", "chat_template_kwargs"]),
}
EXTRA = {   # values aimed at one field's own checks
    "messages": [[{"role": "user"}], [{"content": "x"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url"}]}], [[1]], ["x"]],
    "structured_outputs": [{"regex": 5}, {"regex": "("}, {"choice": []}, {"json": True},
                           {"grammar": "root ::= "}, {"json": {"type": "nope"}}, {"bogus": 1}],
    "response_format": [{"type": "json_schema"}, {"type": "json_schema", "json_schema": {
        "name": "a", "schema": 5}}, {"type": "bogus"}],
    "tools": [[{"type": "function", "function": {}}], [{"type": "function", "function": {
        "name": "f", "parameters": 5}}], [5], [{"type": "function", "name": 5}],
              [{"type": "function", "name": "f", "parameters": 5}], [{"name": "f"}]],
    "tool_choice": ["auto", "required", "bogus", {"type": "function", "function": {}},
                    {"type": "function", "function": {"name": "g"}}],
    "chat_template": ["{{", "{{ raise_exception('x') }}", "{{ messages[9]['x'] }}"],
    "chat_template_kwargs": [{"tools": 1}, {"enable_thinking": False}],
    "use_beam_search": [True, True],
    "input": [[{"role": "user", "content": [{"type": "input_image"}]}], [{"type": "reasoning"}],
              [{"type": "function_call", "name": "f"}], [{"role": "user", "content": [5]}],
              [{"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}]],
    "include": [["message.output_text.logprobs"], ["file_search_call.results"], "x"],
    "text": [{"format": {"type": "json_schema", "schema": {"type": "nope"}}},
             {"format": {"type": "json_schema"}}, {"format": {"type": "json_object"}},
             {"format": 5}],
    "previous_response_id": ["resp_nope"],
    "reasoning": [{"effort": "low"}, {"effort": None}],
    "truncation": ["auto", "bogus"],
}


def _cases(rng: random.Random, pairs: int):
    for path, (base, fields) in ENDPOINTS.items():
        values = {f: WEIRD + EXTRA.get(f, []) for f in fields}
        for field in fields:
            for value in values[field]:
                yield path, {**base, field: value}
        for _ in range(pairs):
            body = dict(base, stream=rng.random() < 0.5)
            for field in rng.sample(fields, 2):
                body[field] = rng.choice(values[field])
            yield path, body
    for path in ("/tokenize", "/detokenize"):
        for field in ("prompt", "tokens", "messages", "add_special_tokens", "chat_template_kwargs"):
            for value in WEIRD:
                yield path, {"prompt": "hi", field: value}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("fuzz")))
    args = EngineArgs(model=path, dtype="float32", max_model_len=256, num_gpu_blocks_override=256)
    async_llm = AsyncLLM.from_engine_args(args)
    with ServerThread(build_app(async_llm, MODEL)) as server:
        yield server
    async_llm.shutdown()


def test_no_request_is_a_5xx(server):
    failures, count = [], 0
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for path, body in _cases(random.Random(0), pairs=150):
            count += 1
            content = json.dumps(body)
            with client.stream("POST", path, content=content,
                               headers={"content-type": "application/json"}) as r:
                text = r.read().decode()
            compact = text.replace(" ", "")
            if r.status_code >= 500 or '"code":500' in compact or "server_error" in compact:
                failures.append(f"{r.status_code} {path} {content[:200]} -> {text[:200]}")
        for body in (b"{", b"null", b"[]", b"5", b'"x"', b'{"a":' * 3000):
            r = client.post("/v1/completions", content=body,
                            headers={"content-type": "application/json"})
            if r.status_code >= 500:
                failures.append(f"{r.status_code} {body[:40]!r}")
        assert client.get("/health").status_code == 200
    assert count > 1000 and not failures, "\n".join(failures[:20])
