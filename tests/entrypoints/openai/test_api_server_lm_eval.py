"""lm-eval-harness (0.4.13, `pip install 'minivllm[eval]'`) as a client of the server: its own CLI
runs a multiple-choice and a generate-until task the test writes (JSONL + YAML through
--include_path) with `local-completions`, and a generate task with `local-chat-completions`.

Every request lm-eval sends and every answer it reads is recorded at the ASGI boundary, and
checked against transformers on the same fp32 weights: the prompt logprobs it sums for
loglikelihoods, and the greedy text it scores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import ServerThread, write_tiny_checkpoint

pytestmark = pytest.mark.slow
MODEL = "tiny"
MC_DOCS = [{"question": "The quick brown", "choices": ["fox", "dog", "cat"], "answer": 0},
           {"question": "Hello world, how are", "choices": ["you", "we", "they"], "answer": 0},
           {"question": "Once upon a time there", "choices": ["was", "is"], "answer": 0}]
GEN_DOCS = [{"prompt": "The quick brown fox", "target": "jumps"},
            {"prompt": "A tiny language model", "target": "for"}]


class Recorder:
    """ASGI middleware keeping each HTTP request's path, JSON body and JSON answer."""

    def __init__(self, app) -> None:
        self.app, self.calls = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, answer = [], []

        async def recording_receive():
            message = await receive()
            body.append(message.get("body", b""))
            return message

        async def recording_send(message):
            if message["type"] == "http.response.body":
                answer.append(message.get("body", b""))
            await send(message)

        await self.app(scope, recording_receive, recording_send)
        self.calls.append((scope["path"], b"".join(body), b"".join(answer)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_lm_eval")))


@contextmanager
def recorded_server(checkpoint: str):
    engine_args = EngineArgs(model=checkpoint, dtype="float32", max_model_len=256,
                             num_gpu_blocks_override=128)
    async_llm = AsyncLLM.from_engine_args(engine_args)
    recorder = Recorder(build_app(async_llm, MODEL))
    with ServerThread(recorder) as server:
        server.recorder = recorder
        yield server
    async_llm.shutdown()


def write_tasks(folder: Path) -> None:
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (folder / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def run_lm_eval(folder: Path, model: str, model_args: str, tasks: str, *extra: str) -> dict:
    out = folder / f"out_{model}"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args",
                           model_args, "--tasks", tasks, "--include_path", str(folder),
                           "--output_path", str(out), "--log_samples", *extra],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    [results] = list(out.rglob("results_*.json"))
    return json.loads(results.read_text())


def hf_model(checkpoint: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(checkpoint)


def test_local_completions_runs_multiple_choice_and_generate_tasks(checkpoint, tmp_path):
    write_tasks(tmp_path)
    with recorded_server(checkpoint) as server:
        args = (f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={checkpoint},"
                "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,"
                "max_retries=1,max_length=256")
        results = run_lm_eval(tmp_path, "local-completions", args, "tiny_mc,tiny_gen")
        calls = [(json.loads(b), json.loads(a)) for path, b, a in server.recorder.calls
                 if path == "/v1/completions"]
    assert 0.0 <= results["results"]["tiny_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["results"]["tiny_gen"]["exact_match,none"] <= 1.0
    assert results["n-samples"]["tiny_mc"]["effective"] == len(MC_DOCS)
    echo = [(req, ans) for req, ans in calls if req.get("echo")]
    gen = [(req, ans) for req, ans in calls if not req.get("echo")]
    assert len(echo) >= sum(len(d["choices"]) for d in MC_DOCS) and len(gen) >= len(GEN_DOCS)
    model, tokenizer = hf_model(checkpoint)
    for req, ans in echo:   # the prompt logprobs lm-eval sums, as transformers has them
        ids = req["prompt"] if isinstance(req["prompt"][0], int) else req["prompt"][0]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        expected = logits[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        got = ans["choices"][0]["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(ids) + req["max_tokens"]
        assert torch.allclose(torch.tensor(got[1:len(ids)]), expected, atol=1e-4)
    for req, ans in gen:    # the greedy text lm-eval scores
        ids = req["prompt"] if isinstance(req["prompt"][0], int) else req["prompt"][0]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=req["max_tokens"],
                                 do_sample=False, pad_token_id=0)
        text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        for stop in req.get("stop") or []:
            text = text.split(stop)[0]
        assert ans["choices"][0]["text"] == text


def test_local_chat_completions_runs_a_generate_task(checkpoint, tmp_path):
    write_tasks(tmp_path)
    with recorded_server(checkpoint) as server:
        args = (f"model={MODEL},base_url={server.url}/v1/chat/completions,num_concurrent=1,"
                "max_retries=1")
        results = run_lm_eval(tmp_path, "local-chat-completions", args, "tiny_gen",
                              "--apply_chat_template")
        calls = [(json.loads(b), json.loads(a)) for path, b, a in server.recorder.calls
                 if path == "/v1/chat/completions"]
    assert 0.0 <= results["results"]["tiny_gen"]["exact_match,none"] <= 1.0
    assert len(calls) == len(GEN_DOCS)
    model, tokenizer = hf_model(checkpoint)
    for req, ans in calls:
        ids = tokenizer.apply_chat_template(req["messages"], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        limit = req.get("max_tokens") or req.get("max_completion_tokens")
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=limit, do_sample=False,
                                 pad_token_id=0)
        text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        for stop in req.get("stop") or []:
            text = text.split(stop)[0]
        assert ans["choices"][0]["message"]["content"] == text
