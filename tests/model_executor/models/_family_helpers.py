"""Shared by the model-family tests: a tiny random transformers checkpoint, minivllm's fp32 greedy
run with prompt logprobs, the same from transformers, and the contract checks (prefixes, every
missing / unexpected name in one error).

Typical use::

    path = write_tiny_checkpoint(tmp, Qwen2Config, Qwen2ForCausalLM, vocab_size=1000)
    assert_matches_transformers(path)
    assert_prefixes_clean(path)
    assert_bad_names_reported(path, tmp / "broken", drop=["model.norm.weight"])
"""

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams

# 2 layers, hidden 64, GQA 4:2; families rename a field or add theirs through `overrides`.
TINY_DENSE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Recurrent-state models run their prompts whole and in chunks of 8 tokens (a state carried
# across chunks). The chunked run also covers a prompt's first chunk from a zero state, so the
# whole-prompt run is in the slow suite only (it kept the default suite under 15 minutes).
STATE_BUDGETS = pytest.mark.parametrize("budget", [
    pytest.param(512, marks=pytest.mark.slow, id="whole_prompts"),
    pytest.param(8, id="chunks_of_8")])
PROMPT_LENS = (5, 17, 33, 60)
NUM_TOKENS = 24


def write_tiny_checkpoint(folder: str | Path, config_cls: type, model_cls: type, seed: int = 0,
                          **overrides) -> str:
    """Save a random `model_cls(config_cls(**TINY_DENSE, **overrides))` in fp32 to `folder`.

    A `None` override drops that default (for configs that do not take the field)."""
    torch.manual_seed(seed)
    fields = {k: v for k, v in {**TINY_DENSE, **overrides}.items() if v is not None}
    config = config_cls(**fields)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():   # norms start at 1 (or 0 for Gemma): a swapped norm would not show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    return str(folder)


def write_checkpoints(tmp_path_factory, family: str, config_cls: type, model_cls: type,
                      configs: dict[str, dict]) -> dict[str, str]:
    """One tiny checkpoint per named config variant: `{variant: path}`."""
    return {name: write_tiny_checkpoint(tmp_path_factory.mktemp(f"{family}_{name}"), config_cls,
                                        model_cls, **overrides)
            for name, overrides in configs.items()}


def make_prompts(vocab_size: int, lens: tuple[int, ...] = PROMPT_LENS,
                 seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lens]


@torch.inference_mode()
def hf_greedy(path: str, prompts: list[list[int]], num_tokens: int = NUM_TOKENS,
              model_cls: type | None = None) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: transformers' greedy tokens and the logprob of every token after the first
    (prompt and generated, float64 `[len - 1]`). Eager attention: soft-capping needs it.
    `model_cls`: the transformers class to run (default AutoModelForCausalLM)."""
    from transformers import AutoModelForCausalLM

    model = (model_cls or AutoModelForCausalLM).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    results = []
    for ids in prompts:
        seq = list(ids)
        for _ in range(num_tokens):    # full recompute: no cache class can differ from ours
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(logits.argmax()))
        logits = model(torch.tensor([seq]), use_cache=False).logits[0]
        logprobs = torch.log_softmax(logits.double(), -1)
        chosen = logprobs[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        results.append((seq[len(ids):], chosen))
    return results


def minivllm_greedy(llm: LLM, prompts: list[list[int]], num_tokens: int = NUM_TOKENS
                    ) -> list[tuple[list[int], torch.Tensor]]:
    """The same as `hf_greedy`, from one batched `llm.generate`."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    results = []
    for ids, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        completion = out.outputs[0]
        prompt_lp = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        gen_lp = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        results.append((list(completion.token_ids),
                        torch.tensor(prompt_lp + gen_lp, dtype=torch.float64)))
    return results


def assert_matches_transformers(path: str, vocab_size: int | None = None,
                                prompts: list[list[int]] | None = None, atol: float = 1e-4,
                                num_tokens: int = NUM_TOKENS, reference: str | None = None,
                                **llm_kwargs) -> None:
    """fp32 greedy tokens identical to transformers, every logprob within `atol`.
    `reference`: the HF folder transformers runs when minivllm's `path` is another format (GGUF)."""
    if prompts is None:
        prompts = make_prompts(vocab_size or TINY_DENSE["vocab_size"])
    ref = hf_greedy(reference or path, prompts, num_tokens)
    kwargs = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 512, **llm_kwargs}
    ours = minivllm_greedy(LLM(model=path, **kwargs), prompts, num_tokens)
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(zip(ours, ref)):
        assert tokens == ref_tokens, f"prompt {i}: tokens differ from transformers"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= atol, f"prompt {i}: logprobs differ by {diff:.3g} (> {atol})"


def assert_preemption_keeps_tokens(path: str) -> None:
    """A model with per-sequence state, run out of cache blocks: sequences are preempted and
    recomputed (their state restarted), and the greedy tokens stay transformers'. 24 blocks of
    4 tokens cannot hold 6 sequences of ~40-80 tokens."""
    prompts = make_prompts(TINY_DENSE["vocab_size"], (17, 33, 40, 25, 50, 12))
    llm = LLM(model=path, dtype="float32", block_size=4, num_gpu_blocks_override=24,
              max_model_len=96)
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
    ours = minivllm_greedy(llm, prompts)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for (tokens, _), (ref_tokens, _) in zip(ours, hf_greedy(path, prompts)):
        assert tokens == ref_tokens


def build_model(path: str, **model_config):
    """minivllm's model for the checkpoint at `path`, TP = PP = 1, fp32."""
    from minivllm.config import ModelConfig, VllmConfig
    from minivllm.distributed import ensure_model_parallel_initialized
    from minivllm.model_executor.model_loader import get_model

    ensure_model_parallel_initialized(1, 1)
    config = VllmConfig(model_config=ModelConfig(model=path, dtype="float32", **model_config))
    return get_model(vllm_config=config)


def assert_prefixes_clean(path: str, expected_cls: str | None = None) -> None:
    """Every layer's prefix equals its attribute path (and the class is the expected one)."""
    from minivllm.model_executor.models.prefix_check import check_prefixes

    model = build_model(path)
    if expected_cls is not None:
        assert type(model).__name__ == expected_cls
    assert check_prefixes(model) == []


def assert_bad_names_reported(path: str, folder: str | Path, drop: list[str],
                              extra: tuple[str, ...] = ("model.layers.0.mlp.extra_proj.weight",
                                                        "model.bogus.weight"),
                              missing: list[str] | None = None) -> None:
    """A copy of the checkpoint without `drop` and with `extra` fails with ONE error naming all
    (`missing`: the parameter names to expect when they differ from the dropped checkpoint names,
    e.g. a fused `qkv_proj.bias` for the dropped q/k/v biases)."""
    import pytest

    state = load_file(os.path.join(path, "model.safetensors"))
    for name in drop:
        del state[name]
    for name in extra:
        state[name] = torch.zeros(2, 2)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(path):
        if name.endswith(".json"):
            shutil.copy(os.path.join(path, name), folder / name)
    with pytest.raises(ValueError) as err:
        build_model(str(folder))
    for name in (*(drop if missing is None else missing), *extra):
        assert name in str(err.value), f"{name} is not named in: {err.value}"


def assert_cpu_graphs_replay_eager_steps(path: str, max_tokens: tuple[int, ...],
                                         vocab_size: int = TINY_DENSE["vocab_size"]):
    """bf16 greedy runs with CPU graphs and without give the same tokens and logprobs (one prompt
    per `max_tokens` entry) and some steps were replayed; returns the graph runner. Skips where
    the native kernels or AMX are missing (bf16 MoE experts then stay in torch)."""
    import pytest

    from minivllm import _custom_ops as ops

    if not ops.native_available() or not ops._has_amx:
        pytest.skip("no AMX here: bf16 experts stay in torch, so steps are not recordable")
    runs = []
    for mode in ("FULL_DECODE_ONLY", "NONE"):
        llm = LLM(model=path, dtype="bfloat16", compilation_config={"cudagraph_mode": mode})
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
                  for n in max_tokens]
        prompts = make_prompts(vocab_size, tuple(4 + 2 * i for i in range(len(max_tokens))))
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(([list(o.outputs[0].token_ids) for o in outs],
                     [[{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs]
                      for o in outs], llm.llm_engine.executor.worker.model_runner.cpu_graphs))
    (tokens, logprobs, graphs), (ref_tokens, ref_logprobs, _) = runs
    assert graphs.num_replays > 0
    assert tokens == ref_tokens and logprobs == ref_logprobs
    return graphs
