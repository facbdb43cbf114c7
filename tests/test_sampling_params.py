"""SamplingParams: vLLM defaults, normalisation and validation errors."""

import re

import numpy as np
import pytest

from minivllm.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.sampling_type == SamplingType.RANDOM


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=None, top_k=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.top_k == 0
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    greedy = SamplingParams(temperature=0, top_k=5, top_p=0.5)
    assert (greedy.top_k, greedy.top_p) == (0, 1.0)


def test_all_stop_token_ids_include_eos_unless_ignored():
    p = SamplingParams(stop_token_ids=[7])
    p.update_from_eos_token_id(2)
    assert p.all_stop_token_ids == {2, 7}
    q = SamplingParams(ignore_eos=True)
    q.update_from_eos_token_id(2)
    assert q.all_stop_token_ids == set()


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=["a", ""]), "stop"),
    (dict(stop="x", detokenize=False), "stop"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_temperature_message_gives_the_value():
    with pytest.raises(ValueError, match="temperature must be non-negative, got -1"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=float("inf")), "top_p"),
    (dict(seed=2**64), "seed"), (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=-2), "prompt_logprobs"),
])
def test_non_finite_and_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    # these failed later (seed=1.5: torch's manual_seed, mid-step) or passed silently
    (dict(seed=1.5), "seed must be an integer or None, got float 1.5"),
    (dict(top_k=1.5), "top_k must be an integer, got float"),
    (dict(n="2"), "n must be an integer, got str"),
    (dict(temperature="0"), "temperature must be a number, got str"),
    (dict(max_tokens=True), "max_tokens must be an integer or None, got bool"),
    (dict(stop=5), "stop must be a string or a list of strings or None"),
    (dict(stop_token_ids=["a"]), "stop_token_ids must be a list of token ids"),
    (dict(allowed_token_ids=[1.0]), "allowed_token_ids must be a list of token ids"),
    (dict(logit_bias={1: "x"}), "logit_bias must be a dict of token id -> bias"),
    (dict(logit_bias={"a": 1}), "logit_bias keys must be token ids"),
    (dict(ignore_eos="yes"), "ignore_eos must be a boolean"),
    (dict(structured_outputs={"regex": "a"}),
     "structured_outputs must be a StructuredOutputsParams"),
])
def test_wrong_types_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_numpy_scalars_are_taken_as_python_numbers():
    params = SamplingParams(seed=np.int64(3), max_tokens=np.int32(5), temperature=np.float32(0.5),
                            stop_token_ids=[np.int64(7)])
    assert params.seed == 3 and type(params.seed) is int and type(params.max_tokens) is int
    assert params.stop_token_ids == [7] and params.temperature == 0.5
