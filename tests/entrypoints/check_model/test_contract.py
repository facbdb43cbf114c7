"""contract and prefixes sections on broken copies of the Llama file."""

from torch import nn

from minivllm.entrypoints.check_model import CheckOptions, run_checks
from minivllm.entrypoints.check_model.contract import check_constructor
from minivllm.entrypoints.check_model.report import Section
from tests.entrypoints.check_model._broken_llama import write_broken_llama


def _errors(report, section: str) -> list:
    return report.sections[section].errors()


def test_clean_copy_passes_contract_and_prefixes(tiny_llama_factory, tmp_path):
    spec = write_broken_llama(tmp_path, "clean")
    report = run_checks(CheckOptions(tiny_llama_factory(), model_file=spec))
    assert report.sections["contract"].status == "pass"
    assert report.sections["prefixes"].status == "pass"
    assert report.sections["contract"].data["protocols"]["SupportsPP"] is True
    assert len(report.sections["prefixes"].data["attention_layers"]) == 2


def test_packed_mapping_with_wrong_shard_count_names_the_fused_layers(tiny_llama_factory,
                                                                      tmp_path):
    spec = write_broken_llama(tmp_path, "packed_shard_count")
    report = run_checks(CheckOptions(tiny_llama_factory(), model_file=spec))
    errors = _errors(report, "contract")
    assert {e.check for e in errors} == {"packed_shard_count"}
    assert [e.layer for e in errors] == ["model.layers.0.mlp.gate_up_proj",
                                         "model.layers.1.mlp.gate_up_proj"]
    assert "1 names ['gate_proj']" in errors[0].message and "2 shards" in errors[0].message
    assert report.sections["prefixes"].status == "pass"
    assert not report.ok


def test_wrong_prefix_on_one_layer_fails_prefixes_only_there(tiny_llama_factory, tmp_path):
    spec = write_broken_llama(tmp_path, "wrong_prefix")
    report = run_checks(CheckOptions(tiny_llama_factory(), model_file=spec))
    errors = _errors(report, "prefixes")
    assert [(e.check, e.layer) for e in errors] == [("prefix_mismatch",
                                                     "model.layers.1.mlp.down_proj")]
    assert "'model.layers.1.mlp.down'" in errors[0].message
    assert report.sections["contract"].status == "pass"


def test_duplicated_attention_name_names_the_second_layer(tiny_llama_factory, tmp_path):
    spec = write_broken_llama(tmp_path, "duplicate_attention")
    report = run_checks(CheckOptions(tiny_llama_factory(), model_file=spec))
    by_check = {e.check: e for e in _errors(report, "prefixes")}
    dup = by_check["duplicate_attention_name"]
    assert dup.layer == "model.layers.1.self_attn.attn"
    assert "'model.layers.0.self_attn.attn'" in dup.message
    assert by_check["prefix_mismatch"].layer == "model.layers.1.self_attn.attn"
    # the model still built, so every other section ran
    assert report.sections["weights"].status == "pass"


def test_constructor_without_vllm_config_keyword_fails():
    class OldStyle(nn.Module):
        def __init__(self, config, prefix=""):
            super().__init__()

    section = Section("contract")
    assert check_constructor(section, OldStyle) is False
    assert section.errors()[0].check == "constructor"
    assert "vllm_config" in section.errors()[0].message


def _contract_of(cls, model) -> dict[str, str]:
    from minivllm.entrypoints.check_model.contract import contract_section

    section = Section("contract")
    contract_section(section, cls, model)
    return {f.check: f.severity for f in section.findings}


def test_protocol_requirements_each_fail():
    from minivllm.model_executor.models.interfaces import SupportsEagle3, SupportsPP

    class NoPP(nn.Module, SupportsPP, SupportsEagle3):
        supports_eagle3 = True

        def __init__(self, *, vllm_config=None, prefix=""):
            super().__init__()

        def forward(self, input_ids, positions):     # no intermediate_tensors
            return input_ids

    found = _contract_of(NoPP, NoPP())
    assert found == {"pp_forward": "error", "pp_intermediate": "error", "eagle3": "error",
                     "embed_input_ids": "warning", "compute_logits": "error"}


def test_eagle3_with_its_own_aux_layer_setter_needs_only_layers():
    # vLLM's DeepSeek file keeps the aux layers itself; only the inherited default needs
    # the inner model's `layers`.
    from minivllm.model_executor.models.interfaces import SupportsEagle3

    class OwnSetter(nn.Module, SupportsEagle3):
        def __init__(self, with_layers: bool):
            super().__init__()
            self.model = nn.Module()
            if with_layers:
                self.model.layers = nn.ModuleList([nn.Linear(2, 2)])

        def set_aux_hidden_state_layers(self, layers):
            self.model.aux_hidden_state_layers = layers

    from minivllm.entrypoints.check_model.contract import _check_eagle3

    for with_layers, expected in ((True, []), (False, ["eagle3"])):
        section = Section("contract")
        _check_eagle3(section, OwnSetter(with_layers))
        assert [f.check for f in section.findings] == expected


def test_fused_layer_missing_from_packed_mapping(tiny_llama_factory, tmp_path):
    # the mapping forgets qkv_proj (and keeps an entry that names no layer)
    from minivllm.entrypoints.check_model.build import build_model, make_target

    target = make_target(tiny_llama_factory(), model_file=write_broken_llama(tmp_path, "clean"))
    model, _ = build_model(target)

    class Forgetful(target.model_class):
        packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"], "wqkv": ["a", "b"]}

    found = _contract_of(Forgetful, model)
    assert found == {"packed_missing": "error", "packed_unused": "warning"}


def test_attention_name_without_one_layer_index():
    from minivllm.entrypoints.check_model.contract import prefixes_section

    model = nn.Module()
    model.block = nn.Module()
    model.block.layer_name = "block"       # an attention layer named without its layer number
    section = Section("prefixes")
    prefixes_section(section, model, [])
    assert [(e.check, e.layer) for e in section.errors()] == [("layer_index", "block")]
