"""The out-of-tree example model (examples/my_llama.py): check-model passes every section on it,
and registered lazily by name it generates what the in-tree Llama generates."""

from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.check_model import CheckOptions, run_checks
from minivllm.model_executor.models.registry import ModelRegistry
from tests.conftest import write_tiny_llama

EXAMPLE = Path(__file__).parent.parent / "examples" / "my_llama.py"
PROMPT = [[5, 17, 42, 99, 3], [7, 8]]


def test_check_model_passes_every_section_on_the_example(tiny_llama_factory):
    report = run_checks(CheckOptions(tiny_llama_factory(), hf=True,
                                     model_file=f"{EXAMPLE}:MyLlamaForCausalLM"))
    assert {s.status for s in report.sections.values()} == {"pass"}, report.to_text()
    assert report.sections["contract"].data["protocols"]["SupportsQuant"] is True
    assert report.sections["parallel"].data["supports_pp"] is True
    assert report.sections["numerics"].data["first_divergence"] is None


@pytest.fixture
def lazily_registered():
    ModelRegistry.register_model("MyLlamaForCausalLM", "examples.my_llama:MyLlamaForCausalLM")
    yield
    ModelRegistry.models.pop("MyLlamaForCausalLM", None)


def _greedy(path: str) -> list[list[int]]:
    llm = LLM(path, dtype="float32", block_size=4, num_gpu_blocks_override=64, max_model_len=128)
    outs = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_registered_by_name_it_matches_the_in_tree_llama(lazily_registered, tmp_path):
    mine = write_tiny_llama(str(tmp_path / "mine"), architectures=["MyLlamaForCausalLM"])
    entry = ModelRegistry.models["MyLlamaForCausalLM"]
    assert repr(entry) == "_LazyRegisteredModel(examples.my_llama:MyLlamaForCausalLM)"
    assert _greedy(mine) == _greedy(write_tiny_llama(str(tmp_path / "ref")))
