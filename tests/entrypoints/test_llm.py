"""A whole bf16 model through the offline LLM with the native kernels off (MINIVLLM_CPU_KERNEL=0):
the pure-PyTorch paths agree with transformers on the same weights."""

import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

PROMPT_LENS = [5, 17, 33]
NUM_TOKENS = 16
# bf16 logits of two implementations differ by a few bf16 roundings (measured: < 0.02 here)
ATOL = 0.05

# NOTE: the kernels' switch is read once per process (`native_available`), and this test
# process has usually loaded them already: the run happens in a fresh interpreter.
_RUN = """
import json, sys
from minivllm import LLM, SamplingParams
from minivllm import _custom_ops as ops

path, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = LLM(model=path, dtype="bfloat16", block_size=4, max_num_batched_tokens=24)
params = SamplingParams(temperature=0, max_tokens=%d, ignore_eos=True, logprobs=0,
                        prompt_logprobs=0)
results = []
for ids, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
    c = o.outputs[0]
    lps = [o.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    lps += [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
    results.append(dict(tokens=c.token_ids, logprobs=lps))
native = dict(tried=ops._tried, loaded=ops._lib is not None, available=ops.native_available())
json.dump(dict(native=native, results=results), open(out, "w"))
""" % NUM_TOKENS


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _run_without_kernels(path: str, prompts: list[list[int]], out: str) -> dict:
    env = {**os.environ, "MINIVLLM_CPU_KERNEL": "0"}
    proc = subprocess.run([sys.executable, "-c", _RUN, path, json.dumps(prompts), out], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


@torch.inference_mode()
def _hf_logprobs(model, seq: list[int]) -> torch.Tensor:
    """[len(seq) - 1, vocab] fp32 logprobs of each next token, bf16 forward."""
    logits = model(torch.tensor([seq])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def test_bf16_llm_without_kernels_matches_transformers(tiny_llama_factory, tmp_path):
    path = tiny_llama_factory()
    prompts = _prompts()
    run = _run_without_kernels(path, prompts, str(tmp_path / "out.json"))
    # the switch was consulted and no kernel library was loaded
    assert run["native"] == dict(tried=True, loaded=False, available=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for ids, res in zip(prompts, run["results"]):
        tokens = res["tokens"]
        assert len(tokens) == NUM_TOKENS
        # teacher-forced on our tokens: a bf16 near-tie may pick the other token, not a worse one
        ref = _hf_logprobs(model, ids + tokens)                     # [len - 1, vocab]
        chosen = ref.gather(1, torch.tensor(ids[1:] + tokens)[:, None])[:, 0]
        ours = torch.tensor(res["logprobs"])
        assert (ours - chosen).abs().max().item() <= ATOL
        best = ref[len(ids) - 1:].max(-1).values                    # [NUM_TOKENS]
        assert (best - chosen[len(ids) - 1:]).max().item() <= ATOL  # greedy, up to bf16 ties
