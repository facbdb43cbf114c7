"""Interactive chat on the terminal: each answer streams token by token."""

import itertools
import sys

from minivllm.sampling_params import SamplingParams


def stream_answer(llm, conversation: list[dict[str, str]], params: SamplingParams,
                  request_id: str, out=sys.stdout) -> str:
    """Run one request through the engine, writing text deltas as they are produced."""
    engine = llm.llm_engine
    engine.add_request(request_id, llm.apply_chat_template(conversation), params)
    printed = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            out.write(text[len(printed):])
            out.flush()
            printed = text
    out.write("\n")
    return printed


def run_chat(llm, params: SamplingParams, system: str | None = None,
             inp=sys.stdin, out=sys.stdout) -> int:
    conversation: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    counter = itertools.count()
    out.write("Chat with the model; an empty line or Ctrl-D quits.\n")
    while True:
        out.write("> ")
        out.flush()
        line = inp.readline()
        if not line or not line.strip():
            return 0
        conversation.append({"role": "user", "content": line.strip()})
        answer = stream_answer(llm, conversation, params, f"chat-{next(counter)}", out)
        conversation.append({"role": "assistant", "content": answer})
