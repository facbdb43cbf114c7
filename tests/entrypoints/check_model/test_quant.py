"""quantization section: the method per layer; ignore entries that reach no layer."""

import json

from minivllm.entrypoints.check_model import CheckOptions, run_checks
from tests.entrypoints.check_model._broken_llama import write_broken_llama


def _fp8_config(tiny: str, folder, ignored: list[str]) -> str:
    config = json.loads((open(f"{tiny}/config.json")).read())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "ignored_layers": ignored}
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_ignored_entry_under_a_missing_path_is_named(tiny_llama_factory, tmp_path):
    config = _fp8_config(tiny_llama_factory(), tmp_path, [
        "model.layers.0.mlp.down_proj", "model.layers.0.feed_forward.down_proj"])
    report = run_checks(CheckOptions(config))         # a config.json alone: dummy weights
    quant = report.sections["quantization"]
    assert report.sections["weights"].status == "skip"
    [error] = quant.errors()
    assert error.check == "ignored_unmatched"
    assert "'model.layers.0.feed_forward.down_proj'" in error.message
    assert error.layer == "model.layers.0.mlp.down_proj"        # the nearest real layer
    methods = quant.data["methods"]
    assert methods["model.layers.0.mlp.down_proj"] == "UnquantizedLinearMethod"
    assert methods["model.layers.1.mlp.down_proj"] == "Fp8LinearMethod"
    assert methods["model.embed_tokens"] == "UnquantizedEmbeddingMethod"


def test_wrong_prefix_quantizes_the_ignored_layer_and_says_so(tiny_llama_factory, tmp_path):
    # The seed's failure: ignored_layers names layer 1's down_proj, whose prefix is wrong.
    config = _fp8_config(tiny_llama_factory(), tmp_path, ["model.layers.1.mlp.down_proj"])
    spec = write_broken_llama(tmp_path, "wrong_prefix")
    report = run_checks(CheckOptions(config, model_file=spec))
    [error] = report.sections["quantization"].errors()
    assert error.layer == "model.layers.1.mlp.down_proj"
    assert "built with prefix 'model.layers.1.mlp.down'" in error.message
    assert "Fp8LinearMethod" in error.message
    assert report.sections["prefixes"].errors()[0].layer == "model.layers.1.mlp.down_proj"


def test_clean_fp8_config_passes(tiny_llama_factory, tmp_path):
    config = _fp8_config(tiny_llama_factory(), tmp_path, ["model.layers.1.mlp.down_proj"])
    report = run_checks(CheckOptions(config))
    assert report.sections["quantization"].status == "pass"
    assert report.sections["quantization"].data["methods"]["model.layers.1.mlp.down_proj"] == \
        "UnquantizedLinearMethod"
    assert report.ok


def test_regex_and_substring_entries(tiny_llama_factory):
    from types import SimpleNamespace

    from minivllm.entrypoints.check_model.build import build_model, make_target
    from minivllm.entrypoints.check_model.quant import quantization_section
    from minivllm.entrypoints.check_model.report import Section

    model, _ = build_model(make_target(tiny_llama_factory()))
    config = SimpleNamespace(get_name=lambda: "fake",
                             ignore=["re:.*self_attn\\.q_proj", "re:model\\.layers\\.9\\..*"],
                             modules_to_not_convert=["layers.1.mlp", "visual"])
    section = Section("quantization")
    quantization_section(section, model, config)
    messages = [e.message for e in section.errors()]
    # q_proj reaches the fused qkv_proj through its shard names; layer 9 and `visual` reach nothing
    assert len(messages) == 2
    assert messages[0].startswith("modules_to_not_convert entry 'visual' matches no layer")
    assert messages[1].startswith("ignore entry 're:model") and "layers" in messages[1]
