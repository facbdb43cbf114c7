"""The bench's random adapters have PEFT's names and shapes, and `bench throughput --num-loras`
spreads its requests over them."""

import json

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from minivllm.benchmarks.lora_adapters import write_random_adapter
from minivllm.entrypoints.cli import main


def test_names_and_shapes_are_peft_s(tiny_checkpoint, tmp_path):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM

    config = LlamaConfig.from_pretrained(tiny_checkpoint)
    ours = load_file(f"{write_random_adapter(str(tmp_path / 'a'), config, 4, seed=0)}"
                     "/adapter_model.safetensors")
    peft = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
    reference = {k: v.shape for k, v in get_peft_model_state_dict(peft).items()}
    assert {k: v.shape for k, v in ours.items()} == reference
    assert all(bool(t.abs().sum() > 0) for t in ours.values())   # B too: not PEFT's zero init
    with open(tmp_path / "a" / "adapter_config.json") as f:
        assert json.load(f)["r"] == 4
    assert torch.equal(ours["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"],
                       load_file(f"{write_random_adapter(str(tmp_path / 'b'), config, 4, 0)}"
                                 "/adapter_model.safetensors")[
                           "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"])


def test_throughput_with_adapters(tiny_checkpoint, tmp_path):
    out = tmp_path / "lora.json"
    assert main(["bench", "throughput", "--model", tiny_checkpoint, "--num-loras", "3",
                 "--lora-rank", "4", "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                 "--disable-tqdm", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["num_loras"], r["lora_rank"]) == (3, 4)
    assert r["num_requests"] == 6 and r["num_output_tokens"] == 24
