"""SpeculativeConfig as vLLM reads it: methods, the n-gram window's defaults, clear errors."""

import argparse

import pytest

from minivllm.config import SpeculativeConfig
from minivllm.engine.arg_utils import EngineArgs


def test_ngram_window_defaults_as_vllm():
    both = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    # vLLM's older spelling: the "model" names the n-gram proposer; any other model is a draft.
    assert SpeculativeConfig(model="[ngram]", num_speculative_tokens=2).method == "ngram"
    draft = SpeculativeConfig(model="/some/draft", num_speculative_tokens=2)
    assert draft.method == "draft_model" and draft.num_lookahead_slots == 2
    # ... and EAGLE heads by vLLM's reading of their names.
    for model, method in (("yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle"),
                          ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"),
                          ("/heads/my-eagle3-head", "eagle3")):
        spec = SpeculativeConfig(model=model, num_speculative_tokens=3)
        assert spec.method == method and spec.use_eagle and spec.num_lookahead_slots == 3
    assert both.num_lookahead_slots == 0


@pytest.mark.parametrize("values, message", [
    ({"num_speculative_tokens": 2}, "needs a method (or a draft model); supported: ngram, "
                                    "draft_model, eagle, eagle3"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs `model`: the draft"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "'mtp' is not supported by minivllm"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "'eagle3' needs `model`: the EAGLE"),
    ({"method": "magic", "num_speculative_tokens": 2}, "not a speculative decoding method"),
    ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     "prompt_lookup_max must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
     "Unknown speculative_config key(s) ['lookahead']; valid keys: method"),
])
def test_bad_configs_name_what_is_valid(values, message):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_dict(values)
    assert message in str(info.value)


def test_cli_flag_parses_json_into_the_engine_config(tiny_llama_factory):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", tiny_llama_factory(), "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=5, prompt_lookup_max=5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1, 2]"])


def test_pooling_engines_refuse_speculation(tiny_llama_factory):
    args = EngineArgs(model=tiny_llama_factory(), runner="pooling",
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pooling runner"):
        args.create_engine_config()
