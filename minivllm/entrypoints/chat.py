"""Interactive chat on the terminal: each answer streams token by token."""

import itertools
import sys

from minivllm.sampling_params import SamplingParams


class StrippedStream:
    """Writes text deltas as `print(text.strip())` would show the whole text: leading whitespace
    dropped, trailing whitespace held back until more text follows it, each visible character
    written (and flushed) as soon as it arrives."""

    def __init__(self, out=sys.stdout) -> None:
        self.out, self.started, self.held = out, False, ""

    def write(self, delta: str) -> None:
        if not self.started:
            delta = delta.lstrip()
            if not delta:
                return
            self.started = True
        text = self.held + delta
        body = text.rstrip()
        self.held = text[len(body):]
        if body:
            self.out.write(body)
            self.out.flush()

    def close(self) -> None:
        self.out.write("\n")
        self.out.flush()


def stream_prompt(llm, prompt, params: SamplingParams, request_id: str, out) -> str:
    """Run one request (text or token ids) through the engine, writing each step's text delta
    to `out` (anything with write) as it is produced; returns the whole text."""
    engine = llm.llm_engine
    engine.add_request(request_id, prompt, params)
    printed = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            out.write(text[len(printed):])
            printed = text
    return printed


def stream_answer(llm, conversation: list[dict[str, str]], params: SamplingParams,
                  request_id: str, out=sys.stdout) -> str:
    """One chat turn, its answer streamed to `out` as it is produced."""
    stream = StrippedStream(out)
    answer = stream_prompt(llm, llm.apply_chat_template(conversation), params, request_id,
                           stream)
    stream.close()
    return answer


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
