"""A tiny checkpoint with a real tokenizer, and a real uvicorn server on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai

import uvicorn
from transformers import PreTrainedTokenizerFast

from tests.conftest import make_bpe_tokenizer, write_tiny_llama

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world, how are you today?",
         "A tiny language model for tests of the server.", "Once upon a time there was a cat."]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences, with a chat template: ids 0-2 are <pad>, <s>,
    </s> (the tiny Llama's pad, bos and eos)."""
    fast = make_bpe_tokenizer(TEXTS * 4, vocab_size)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tiny_checkpoint(folder: str, **overrides) -> str:
    """A random tiny Llama plus the tokenizer above, in one HF folder. The model's vocabulary is
    the tokenizer's, so that every sampled id decodes to text."""
    tokenizer = make_tokenizer()
    write_tiny_llama(folder, **{"vocab_size": len(tokenizer), **overrides})
    tokenizer.save_pretrained(folder)
    return folder


class ServerThread:
    """Runs uvicorn for `app` in a daemon thread on a port the OS picked."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@contextmanager
def serve(async_llm, app) -> Iterator[ServerThread]:
    """`app` on a loopback port for the block; then `async_llm` (the app's engine) shut down."""
    with ServerThread(app) as server:
        yield server
    async_llm.shutdown()


def openai_client(server: ServerThread) -> openai.OpenAI:
    """The official client on `server`'s /v1, without retries (a test sees every error)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
