"""run_checks on each kind of MODEL: a HF folder, a GGUF file, a config.json alone."""

import json

from minivllm.entrypoints.check_model import CheckOptions, run_checks


def test_gguf_file_passes_with_packed_methods(default_model_path):
    report = run_checks(CheckOptions(default_model_path))
    assert report.ok, report.to_text()
    weights = report.sections["weights"]
    assert weights.data["unexpected"] == [] and weights.data["missing"] == []
    assert report.sections["quantization"].data["quantization"] == "gguf"
    assert report.sections["numerics"].status == "skip"


def test_config_json_alone_uses_dummy_weights(tiny_llama_factory, tmp_path):
    config = tmp_path / "config.json"
    config.write_text((open(f"{tiny_llama_factory()}/config.json")).read())
    report = run_checks(CheckOptions(str(config), hf=True))
    assert report.ok
    assert report.sections["weights"].status == "skip"
    assert "dummy" in report.sections["weights"].findings[0].message
    assert report.sections["numerics"].status == "skip"     # transformers needs the weights


def test_a_model_that_cannot_be_built_skips_the_rest(tiny_llama_factory, tmp_path):
    # hidden_act the Llama MLP does not support: the constructor raises
    fields = json.loads(open(f"{tiny_llama_factory()}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**fields, "hidden_act": "gelu"}))
    report = run_checks(CheckOptions(str(tmp_path / "config.json")))
    [error] = report.sections["contract"].errors()
    assert error.check == "build" and "Unsupported activation: gelu" in error.message
    assert {report.sections[n].status for n in report.sections if n != "contract"} == {"skip"}
    assert not report.ok
