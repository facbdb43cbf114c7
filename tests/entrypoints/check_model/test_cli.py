"""`minivllm check-model`: exit status and the --json report."""

import json

from minivllm.entrypoints.cli import main
from tests.entrypoints.check_model._broken_llama import write_broken_llama

_SECTION_KEYS = ["name", "status", "summary", "findings", "data"]
_FINDING_KEYS = ["severity", "check", "message", "layer", "fix"]


def test_clean_model_exits_0_with_the_documented_json(tiny_llama_factory, capsys):
    assert main(["check-model", tiny_llama_factory(), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report) == ["schema_version", "model", "architecture", "model_class", "ok",
                            "sections"]
    assert report["schema_version"] == 1 and report["ok"] is True
    assert report["model_class"] == "minivllm.model_executor.models.llama:LlamaForCausalLM"
    assert [s["name"] for s in report["sections"]] == [
        "contract", "prefixes", "weights", "quantization", "parallel", "numerics"]
    assert all(list(s) == _SECTION_KEYS for s in report["sections"])
    assert report["sections"][-1]["status"] == "skip"


def test_broken_model_file_exits_1_naming_the_layer(tiny_llama_factory, tmp_path, capsys):
    spec = write_broken_llama(tmp_path, "wrong_prefix")
    assert main(["check-model", tiny_llama_factory(), "--model-file", spec, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    prefixes = next(s for s in report["sections"] if s["name"] == "prefixes")
    assert prefixes["status"] == "fail"
    [finding] = prefixes["findings"]
    assert list(finding) == _FINDING_KEYS
    assert finding["layer"] == "model.layers.1.mlp.down_proj"


def test_text_report_lists_sections_and_the_failure(tiny_llama_factory, tmp_path, capsys):
    spec = write_broken_llama(tmp_path, "packed_shard_count")
    assert main(["check-model", tiny_llama_factory(), "--model-file", spec]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] contract" in out and "[PASS] prefixes" in out
    assert "model.layers.0.mlp.gate_up_proj:" in out
    assert out.rstrip().endswith("FAILED: contract")


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    assert main(["check-model", str(tmp_path / "nothing")]) == 2
    assert "HF checkpoint folder, a .gguf file or a config.json" in capsys.readouterr().err
