"""minivllm.envs: variables read at each access, fixed vLLM switches reported when set."""

import logging

import pytest

from minivllm import envs


def test_values_follow_the_environment(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert envs.VLLM_PP_LAYER_PARTITION is None and not envs.is_set("VLLM_PP_LAYER_PARTITION")
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert envs.VLLM_PP_LAYER_PARTITION == "1,3" and envs.is_set("VLLM_PP_LAYER_PARTITION")


def test_pp_partition_is_read_through_envs(monkeypatch):
    from minivllm.distributed.utils import get_pp_indices

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert [get_pp_indices(4, r, 2) for r in (0, 1)] == [(0, 1), (1, 4)]


def test_fixed_switches_and_unknown_names(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    monkeypatch.setattr(envs, "_reported", set())
    with caplog.at_level(logging.WARNING):
        assert envs.VLLM_USE_DEEP_GEMM is False
    assert "VLLM_USE_DEEP_GEMM=1 is ignored" in caplog.text
    assert "VLLM_USE_DEEP_GEMM" in dir(envs)
    with pytest.raises(AttributeError, match="VLLM_NOT_A_VARIABLE.*known: "):
        envs.VLLM_NOT_A_VARIABLE  # noqa: B018
