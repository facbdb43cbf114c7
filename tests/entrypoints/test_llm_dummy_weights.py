"""`load_format="dummy"`: deterministic random weights, no checkpoint, for every engine command."""

import json

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.cli import build_parser

PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9]]


def _config_only_folder(tiny: str, folder) -> str:
    """A folder holding nothing but the checkpoint's config.json."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(json.load(open(f"{tiny}/config.json"))))
    return str(folder)


def _greedy(path: str, seed: int) -> tuple[list[list[int]], torch.Tensor]:
    llm = LLM(path, load_format="dummy", seed=seed, dtype="float32", block_size=4,
              num_gpu_blocks_override=64, max_model_len=128)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)
    llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [lp[t].logprob for o in outs
                for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    return tokens, torch.tensor(logprobs, dtype=torch.float64)


def test_dummy_weights_are_deterministic_without_a_checkpoint(tiny_llama_factory, tmp_path):
    path = _config_only_folder(tiny_llama_factory(), tmp_path / "config_only")
    tokens, logprobs = _greedy(path, seed=0)
    again_tokens, again_logprobs = _greedy(path, seed=0)
    assert again_tokens == tokens
    torch.testing.assert_close(again_logprobs, logprobs, rtol=0, atol=1e-5)
    other_tokens, other_logprobs = _greedy(path, seed=1)      # other weights
    assert other_tokens != tokens or (other_logprobs - logprobs).abs().max() > 1e-5


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"],
                                     ["bench", "throughput"], ["bench", "latency"]])
def test_every_engine_command_takes_load_format_dummy(command):
    args = build_parser().parse_args([*command, "--load-format", "dummy"])
    assert args.load_format == "dummy"
