"""Responses API bodies: input items as chat messages, the chat request a Responses request
becomes, and output items turned back into the messages that continue a conversation."""

from __future__ import annotations

import pytest

from minivllm.entrypoints.openai.protocol import ChatCompletionRequest
from minivllm.entrypoints.openai.responses_protocol import (ResponsesRequest, function_call_item,
                                                            input_messages, message_item,
                                                            output_messages)


def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Weather in "},
                          {"type": "input_text", "text": "Paris and Rome?"}]},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"c": "P"}'},
             {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"c": "R"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "rain"}]}]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": '{"c": "R"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("items, match", [
    ([{"type": "item_reference"}], r"input\[0\] has type 'item_reference'; valid input"),
    ([{"role": "tool", "content": "x"}], r"input\[0\].role must be one of user"),
    ([{"role": "user", "content": [{"type": "input_image"}]}], "valid part types"),
    ([{"role": "user", "content": 5}], "string or a list of text parts"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], r"input\[0\].call_id"),
])
def test_bad_input_items_are_named(items, match):
    with pytest.raises(ValueError, match=match):
        input_messages(items)


def test_output_items_continue_the_conversation():
    output = [message_item("Let me check.", "completed"),
              function_call_item("w", '{"c": "P"}', "completed", call_id="c9")]
    assert output_messages(output) == [
        {"role": "assistant", "content": "Let me check."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c9", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}}]}]


def test_the_chat_request_a_responses_request_becomes():
    request = ResponsesRequest(
        input="x", max_output_tokens=7, temperature=0.5, top_logprobs=3,
        include=["message.output_text.logprobs"],
        tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "w"},
        text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"},
                         "strict": True}})
    chat = ChatCompletionRequest.model_validate(
        request.chat_request_fields([{"role": "user", "content": "x"}]))
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5
    assert chat.logprobs and chat.top_logprobs == 3
    assert chat.tools == [{"type": "function", "function": {"name": "w",
                                                            "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}}
    assert chat.tool_mode == "named"
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.json_schema == {"type": "object"}
    # top_logprobs alone returns none (OpenAI's include decides); no tools: no tool_choice
    plain = ResponsesRequest(input="x", top_logprobs=3).chat_request_fields([])
    assert not plain["logprobs"] and plain["top_logprobs"] is None and "tool_choice" not in plain


@pytest.mark.parametrize("fields, match", [
    ({"include": ["file_search_call.results"]}, "include 'file_search_call.results'"),
    ({"reasoning": {"effort": "low"}}, "reasoning options .effort, summary. are not supported"),
    ({"tools": [{"type": "web_search_preview"}]}, "only function tools"),
])
def test_what_is_not_served_is_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        ResponsesRequest(input="x", **fields).check_supported()
    ResponsesRequest(input="x", reasoning={"effort": None},
                     include=["reasoning.encrypted_content"]).check_supported()
