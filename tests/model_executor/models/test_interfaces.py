"""Capability interfaces on toy classes: detection, SupportsQuant wiring, EAGLE-3 mixins."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig

from minivllm.config import ModelConfig, VllmConfig
from minivllm.distributed import GroupCoordinator, initialize_model_parallel
from minivllm.model_executor.models import interfaces
from minivllm.model_executor.models.interfaces import (EagleModelMixin, LocalArgmaxMixin, SupportsEagle,
                                                       SupportsEagle3, SupportsLoRA, SupportsPP,
                                                       SupportsQuant, is_text_generation_model,
                                                       supports_eagle, supports_eagle3, supports_lora,
                                                       supports_pp, supports_quant)
from minivllm.model_executor.models.interfaces_base import is_pooling_model, is_vllm_model
from minivllm.model_executor.models.utils import WeightsMapper
from minivllm.sequence import IntermediateTensors


class Inner(nn.Module, EagleModelMixin):
    def __init__(self, num_layers: int = 8) -> None:
        super().__init__()
        self.start_layer = 0
        self.layers = nn.ModuleList([nn.Identity() for _ in range(num_layers)])


class FullModel(LocalArgmaxMixin, nn.Module, SupportsLoRA, SupportsPP, SupportsEagle, SupportsEagle3,
                SupportsQuant):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    embedding_modules = {"embed_tokens": "input_embeddings"}
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"old.": "new."},
                                      orig_to_new_stacked={".q_proj": (".qkv_proj", "q")})

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        self.model = Inner()

    def embed_input_ids(self, input_ids):
        return input_ids

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return input_ids

    def compute_logits(self, hidden_states):
        return hidden_states

    def make_empty_intermediate_tensors(self, batch_size, dtype, device):
        return IntermediateTensors({})


class Bare(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()

    def forward(self, input_ids, positions):
        return input_ids


def _vllm_config(quant_config=None) -> VllmConfig:
    cfg = VllmConfig(model_config=ModelConfig(model="dummy", hf_config=LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128)))
    cfg.quant_config = quant_config
    return cfg


def test_detection_on_full_and_bare_classes():
    model = FullModel(vllm_config=_vllm_config())
    for target in (FullModel, model):
        assert supports_pp(target) and supports_lora(target) and supports_quant(target)
        assert supports_eagle(target) and supports_eagle3(target)
        assert is_vllm_model(target) and is_text_generation_model(target)
        assert not is_pooling_model(target)
    for target in (Bare, Bare(vllm_config=None)):
        assert not (supports_pp(target) or supports_lora(target) or supports_quant(target))
        assert not (supports_eagle(target) or supports_eagle3(target))
        assert is_vllm_model(target) and not is_text_generation_model(target)
    assert isinstance(model, SupportsPP) and isinstance(model, SupportsEagle3)


def test_supports_pp_needs_intermediate_tensors_keyword():
    class NoKw(nn.Module, SupportsPP):
        def forward(self, input_ids, positions):
            return input_ids

    class AttributesOnly(nn.Module):
        supports_pp = True

        def make_empty_intermediate_tensors(self, *a):
            return None

        def forward(self, input_ids, positions, intermediate_tensors=None):
            return input_ids

    assert not supports_pp(NoKw)
    assert supports_pp(AttributesOnly)


def test_lora_defaults():
    class Lora(nn.Module, SupportsLoRA):
        pass

    assert supports_lora(Lora)
    assert Lora.embedding_modules == {} and Lora.packed_modules_mapping == {}
    assert Lora.lora_skip_prefixes == [] and Lora.is_3d_moe_weight is False


class FakeQuantConfig:
    def __init__(self) -> None:
        self.packed_modules_mapping = {"existing": ["a"]}
        self.mappers = []

    def apply_vllm_mapper(self, mapper) -> None:
        self.mappers.append(mapper)


def test_supports_quant_new_wires_config_before_init():
    quant = FakeQuantConfig()
    model = FullModel(vllm_config=_vllm_config(quant))
    assert model.quant_config is quant
    assert quant.packed_modules_mapping == {"existing": ["a"], **FullModel.packed_modules_mapping}
    (mapper,) = quant.mappers
    assert mapper.orig_to_new_stacked == {} and mapper.orig_to_new_prefix == {"old.": "new."}
    assert FullModel(vllm_config=_vllm_config()).quant_config is None


def test_eagle3_bodies_and_mixin_capture():
    initialize_model_parallel(1, 1)
    model = FullModel(vllm_config=_vllm_config())
    assert model.get_eagle3_default_aux_hidden_state_layers() == (2, 4, 5)
    model.set_aux_hidden_state_layers((4, 0, 4))
    inner = model.model
    assert inner.aux_hidden_state_layers == (0, 4)
    aux: list[torch.Tensor] = []
    h, r = torch.ones(2, 3), torch.full((2, 3), 2.0)
    inner._maybe_add_hidden_state(aux, 0, h, None)
    inner._maybe_add_hidden_state(aux, 1, h, r)
    inner._maybe_add_hidden_state(aux, 4, h, r)
    assert len(aux) == 2 and torch.equal(aux[0], h) and torch.equal(aux[1], h + r)
    assert list(inner.pack_local_aux_hidden_states(aux)) == ["aux_hidden_states_0", "aux_hidden_states_1"]
    assert inner.collect_remote_aux_hidden_states(None) == []


def test_eagle3_needs_mixin_holder():
    class NoMixin(nn.Module, SupportsEagle3):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()

    with pytest.raises(AssertionError, match="EagleModelMixin"):
        NoMixin().set_aux_hidden_state_layers((1,))


def test_eagle_mixin_pp_layout(monkeypatch):
    import minivllm.model_executor.models.interfaces as dist   # the names the mixin calls

    last = GroupCoordinator([0, 1], 1, None, "pp")
    monkeypatch.setattr(dist, "get_pp_group", lambda: last)
    monkeypatch.setattr(dist, "model_parallel_is_initialized", lambda: True)
    inner = Inner()
    inner.supports_aux_hidden_states_over_pp = True
    inner.start_layer = 4
    inner._set_aux_hidden_state_layers((0, 2, 6))   # 0 and 2 are captured by stage 0
    assert inner.pack_local_aux_hidden_states([torch.ones(1)]) == {"aux_hidden_states_2": torch.ones(1)}
    remote = IntermediateTensors({"aux_hidden_states_0": torch.zeros(1), "aux_hidden_states_1": torch.ones(1)})
    assert [t.item() for t in inner.collect_remote_aux_hidden_states(remote)] == [0.0, 1.0]
    with pytest.raises(RuntimeError, match="Missing aux_hidden_states_i"):
        inner.collect_remote_aux_hidden_states(IntermediateTensors({"aux_hidden_states_0": torch.zeros(1)}))


def test_local_argmax_maps_draft_ids():
    class Drafter(LocalArgmaxMixin):
        lm_head = object()
        logits_processor = SimpleNamespace(get_top_tokens=lambda head, h: h.argmax(-1))

    drafter = Drafter()
    hidden = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    assert drafter.get_top_tokens(hidden).tolist() == [1, 0]
    drafter.draft_id_to_target_id = torch.tensor([10, 20, 30])
    assert drafter.get_top_tokens(hidden).tolist() == [21, 10]


def test_interfaces_module_exports():
    from minivllm.model_executor import models

    assert models.SupportsPP is SupportsPP and models.supports_pp is supports_pp
    assert set(interfaces.__all__) >= {"SupportsQuant", "EagleModelMixin", "LocalArgmaxMixin"}
