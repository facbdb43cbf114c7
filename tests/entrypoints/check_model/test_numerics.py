"""numerics section (--hf): per-layer comparison with transformers, the first divergence."""

import pytest

from minivllm.entrypoints.check_model import CheckOptions, run_checks
from minivllm.entrypoints.check_model.numerics import compare_layers
from minivllm.model_executor.models.registry import ModelRegistry
from tests.entrypoints.check_model._broken_llama import write_broken_llama


def test_injected_mlp_bug_is_found_in_both_trees(tiny_llama_factory, tmp_path):
    spec = write_broken_llama(tmp_path, "mlp_numerics")
    report = run_checks(CheckOptions(tiny_llama_factory(), model_file=spec, hf=True))
    numerics = report.sections["numerics"]
    assert numerics.data["first_divergence"] == {"module": "model.layers.1.mlp",
                                                 "hf_modules": ["model.layers.1.mlp"]}
    [divergence] = [e for e in numerics.errors() if e.check == "divergence"]
    assert "logprobs" in {e.check for e in numerics.errors()}     # 1% shows in the logprobs
    assert divergence.layer == "model.layers.1.mlp"
    rows = {r["module"]: r for r in numerics.data["layers"]}
    # everything up to the bug matches; the fused layers were compared to the shards' concat
    assert rows["model.layers.1.mlp.down_proj"]["ok"]
    assert rows["model.layers.0.self_attn.qkv_proj"]["hf_modules"] == [
        f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert rows["model.layers.1.mlp"]["max_rel_error"] > 1e-3
    # the engine ran the broken class; the registry entry is back afterwards
    assert ModelRegistry.models["LlamaForCausalLM"].load_model_cls().__module__ == \
        "minivllm.model_executor.models.llama"


def test_clean_copy_passes_every_section(tiny_llama_factory, tmp_path):
    spec = write_broken_llama(tmp_path, "clean")
    report = run_checks(CheckOptions(tiny_llama_factory(), model_file=spec, hf=True))
    assert {n: s.status for n, s in report.sections.items()} == {
        "contract": "pass", "prefixes": "pass", "weights": "pass", "quantization": "pass",
        "parallel": "pass", "numerics": "pass"}
    numerics = report.sections["numerics"]
    assert len(numerics.data["layers"]) == 20 and numerics.data["first_divergence"] is None
    assert len(numerics.data["tokens"]) == 8 and numerics.data["max_logprob_diff"] < 1e-4


def test_compare_layers_sums_a_decoder_layers_residual():
    import torch

    branch, residual = torch.ones(3, 4), torch.full((3, 4), 2.0)
    mv = {"model.layers.0": (branch, residual), "model.norm": (torch.ones(3, 4), residual)}
    hf = {"model.layers.0": torch.full((1, 3, 4), 3.0), "model.norm": torch.ones(1, 3, 4)}
    rows = compare_layers(mv, hf, {}, rtol=1e-3)
    assert [(r["module"], r["ok"]) for r in rows] == [("model.layers.0", True), ("model.norm", True)]
    hf["model.layers.0"] = torch.full((1, 3, 4), 2.0)     # transformers without the branch
    assert not compare_layers(mv, hf, {}, rtol=1e-3)[0]["ok"]


def test_numerics_is_skipped_without_hf(tiny_llama_factory):
    report = run_checks(CheckOptions(tiny_llama_factory()))
    assert report.sections["numerics"].status == "skip"
    assert "--hf" in report.sections["numerics"].findings[0].message


class _FixedLogits:
    """A stand-in transformers model whose next-token logits are the same at every step."""

    def __init__(self, logits):
        self.logits = logits

    def __call__(self, input_ids):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.logits.expand(1, input_ids.shape[1], -1))


def _greedy_findings(hf_logits, mv_tokens, mv_top):
    import torch

    from minivllm.entrypoints.check_model.numerics import _compare_greedy
    from minivllm.entrypoints.check_model.report import Section
    from minivllm.outputs import Logprob

    lp = torch.log_softmax(hf_logits.double(), -1)
    mv_logprobs = [{t: Logprob(float(lp[t])) for t in mv_top} for _ in mv_tokens]
    section = Section("numerics")
    _compare_greedy(section, _FixedLogits(hf_logits.view(1, 1, -1)), [1, 2], mv_tokens,
                    mv_logprobs, atol=1e-3)
    return [(f.check, f.severity) for f in section.findings]


def test_greedy_near_tie_is_reported_not_failed():
    import torch

    logits = torch.tensor([0.0, 5.0, 4.999, -3.0, -4.0, -5.0, -6.0, -7.0])
    # transformers picks 1, minivllm 2; each is in the other's top 5
    assert _greedy_findings(logits, [2, 2], mv_top=[2, 1]) == [("near_tie", "info")]


def test_greedy_tokens_that_are_no_tie_fail():
    import torch

    logits = torch.tensor([0.0, 9.0, 1.0, 1.5, 2.0, 2.5, 3.0, -9.0])
    assert _greedy_findings(logits, [7], mv_top=[7]) == [("tokens", "error")]


def test_a_mismatch_that_later_rows_absorb_is_a_warning():
    from minivllm.entrypoints.check_model.numerics import _report_layers
    from minivllm.entrypoints.check_model.report import Section

    def row(name, ok):
        return {"module": name, "hf_modules": [name], "max_abs_error": 0.0 if ok else 1.0,
                "max_rel_error": 0.0 if ok else 0.9, "ok": ok}

    section = Section("numerics")
    _report_layers(section, [row("embed", False), row("layer0", True), row("norm", True)], 1e-3)
    assert [(f.check, f.severity, f.layer) for f in section.findings] == [
        ("local_mismatch", "warning", "embed")]
    assert section.data["first_divergence"] is None
    section = Section("numerics")
    _report_layers(section, [row("embed", False), row("layer0", True), row("layer1", False),
                             row("norm", False)], 1e-3)
    assert section.data["first_divergence"]["module"] == "layer1"
    assert [f.check for f in section.errors()] == ["divergence"]


@pytest.mark.slow
def test_gguf_file_is_compared_dequantised(default_model_path):
    report = run_checks(CheckOptions(default_model_path, hf=True, max_tokens=4))
    numerics = report.sections["numerics"]
    assert numerics.status == "pass", numerics.findings
    assert len(numerics.data["layers"]) > 200 and numerics.data["first_divergence"] is None
