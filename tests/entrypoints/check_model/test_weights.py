"""weights section: checkpoint names that fill nothing, parameters nothing fills, the fix."""

from minivllm.entrypoints.check_model import CheckOptions, run_checks
from minivllm.entrypoints.check_model.weights import nearest, part_distance
from tests.entrypoints.check_model._broken_llama import write_broken_llama


def test_part_distance_prefers_the_similar_part():
    assert part_distance("model.layers.0.mlp.gate_proj.weight",
                         "model.layers.0.mlp.gate_proj.weight") == 0
    # one part substituted costs less than a part inserted, and a near part less than a far one
    near = part_distance("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.gate_proj.weight")
    far = part_distance("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.down_proj.weight")
    assert 0.5 <= near < far <= 1.0
    assert nearest("layers.1.mlp.up_proj.weight",
                   ["layers.0.mlp.up_proj.weight", "layers.1.mlp.up_proj.weight"])[0] == \
        "layers.1.mlp.up_proj.weight"


def test_missing_stacked_rule_names_both_sides_and_the_rule(tiny_llama_factory, tmp_path):
    spec = write_broken_llama(tmp_path, "missing_mapping")
    report = run_checks(CheckOptions(tiny_llama_factory(), model_file=spec))
    weights = report.sections["weights"]
    assert weights.status == "fail"
    unexpected = [e for e in weights.errors() if e.check == "unexpected"]
    missing = [e for e in weights.errors() if e.check == "missing"]
    assert sorted(e.layer for e in unexpected) == [
        f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up")]
    assert sorted(e.layer for e in missing) == ["model.layers.0.mlp.gate_up_proj",
                                                "model.layers.1.mlp.gate_up_proj"]
    gate = next(e for e in unexpected if e.layer == "model.layers.0.mlp.gate_proj")
    assert "nearest parameter: 'model.layers.0.mlp.gate_up_proj.weight' " \
           "(checkpoint name 'model.layers.0.mlp.gate_proj.weight')" in gate.message
    rules = {r["rule"]: r["count"] for r in weights.data["rules"]}
    assert any('{".gate_proj": (".gate_up_proj", 0)}' in r and n == 2 for r, n in rules.items())
    assert any('{".up_proj": (".gate_up_proj", 1)}' in r and n == 2 for r, n in rules.items())
    assert {e.check for e in weights.errors()} == {"unexpected", "missing", "systematic_mismatch"}
    assert report.sections["numerics"].status == "skip"


def test_renamed_checkpoint_gets_a_substr_rule(tiny_llama_factory, tmp_path):
    # A checkpoint that calls the attention block `attention` (as some exporters do).
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_llama_factory()
    folder = tmp_path / "renamed"
    shutil.copytree(src, folder)
    state = load_file(str(folder / "model.safetensors"))
    save_file({k.replace(".self_attn.", ".attention."): v for k, v in state.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    weights = run_checks(CheckOptions(str(folder))).sections["weights"]
    systematic = [e for e in weights.errors() if e.check == "systematic_mismatch"]
    assert systematic and all('".attention.": ".self_attn."' in e.fix for e in systematic)
    assert len([e for e in weights.errors() if e.check == "unexpected"]) == 8


def test_a_tensor_of_the_wrong_shape_is_a_load_error(tiny_llama_factory, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad_shape"
    shutil.copytree(tiny_llama_factory(), folder)
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 100)   # intermediate is 128
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    weights = run_checks(CheckOptions(str(folder))).sections["weights"]
    [error] = [e for e in weights.errors() if e.check == "load_error"]
    assert error.layer == "model.layers.1.mlp.down_proj.weight"


def test_moe_experts_count_as_loaded_once_all_arrive(tmp_path):
    # FusedMoE reports w13_weight / w2_weight only when every expert's shard has been loaded
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128)).save_pretrained(str(tmp_path))
    weights = run_checks(CheckOptions(str(tmp_path))).sections["weights"]
    assert weights.status == "pass", weights.findings
