"""Structured outputs offline, on the default model (a real 49k-token tokenizer): JSON schema,
regex, choice and grammar constraints hold through n > 1, stop strings, preemption and prefix
caching; bad constraints are ValueErrors naming the problem."""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import jsonschema
import pytest

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.v1.structured_output import validate_structured_outputs

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = "Describe a person as JSON with a name and an age:"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, num_gpu_blocks_override=128)


def _sampled(constraint: StructuredOutputsParams, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=kwargs.pop("max_tokens", 40),
                          structured_outputs=constraint, **kwargs)


def test_json_schema_n2_regex_choice_grammar_in_one_batch(llm):
    params = [_sampled(StructuredOutputsParams(json=SCHEMA), seed=1, n=2),
              _sampled(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), seed=2),
              _sampled(StructuredOutputsParams(choice=["yes", "no", "maybe"]), seed=3),
              _sampled(StructuredOutputsParams(grammar='start: "ab" NUM\nNUM: /[0-9]{2}/'), seed=4),
              SamplingParams(temperature=0, max_tokens=8)]
    # Grammars compile off the engine loop: while they do, the free request runs alone and the
    # constrained prompts join it later in mixed steps (another kernel path for its rows on
    # AVX2). A first run leaves them compiled in the cache, so the checked run starts all six
    # sequences in its first step, as the unconstrained batch below does.
    llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert len(outs[0].outputs) == 2
    for choice in outs[0].outputs:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
        assert choice.finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].outputs[0].text)
    assert outs[2].outputs[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"ab[0-9]{2}", outs[3].outputs[0].text)
    # The free request is the same as in the same batch without constraints: the bitmask touched
    # only the constrained rows. (Against the request alone, a 5-prompt step's linears would be
    # another kernel path than a 1-prompt step's on some CPUs: bf16 vs fp32 tiles on AVX2.)
    unconstrained = [dataclasses.replace(p, structured_outputs=None) for p in params]
    same_batch = llm.generate([PROMPT] * len(params), unconstrained, use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == same_batch[-1].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids != same_batch[0].outputs[0].token_ids   # constrained


def test_stop_string_cuts_constrained_output(llm):
    out = llm.generate([PROMPT], _sampled(StructuredOutputsParams(regex=r"abc,def,ghi"), seed=0,
                                         stop=[","]), use_tqdm=False)[0].outputs[0]
    assert out.text == "abc" and out.stop_reason == ","


def test_preemption_and_prefix_caching_keep_the_grammar():
    # Each sequence grows to ~76 tokens (5 blocks of 16, 2 of them a shared cached prefix):
    # 8 blocks cannot hold even 2 of them, so the scheduler preempts and recomputes.
    llm = LLM(max_model_len=128, num_gpu_blocks_override=8)
    params = _sampled(StructuredOutputsParams(regex=r"( [0-9]){20}"), seed=5, max_tokens=48)
    prompt = PROMPT * 3   # two full blocks: the first request leaves them in the prefix cache
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    outs = llm.generate([prompt] * 4, [params] * 4, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert all(o.num_cached_tokens >= 32 for o in outs)
    # A preempted request keeps its grammar state through the recompute (its tokens are not
    # fed twice): every output still matches, complete. (Texts may differ: recomputed bf16
    # logits are not bit-equal to decoded ones.)
    for out in outs + [first]:
        assert re.fullmatch(r"( [0-9]){20}", out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("constraint, problem", [
    (StructuredOutputsParams(regex="a(b"), "unclosed group"),
    (StructuredOutputsParams(json='{"type": '), "not valid JSON"),
    (StructuredOutputsParams(json={"type": "no-such-type"}), "no-such-type"),
    (StructuredOutputsParams(grammar="start: missing_rule"), "missing_rule"),
])
def test_invalid_constraints_name_the_problem(llm, constraint, problem):
    with pytest.raises(ValueError, match=problem):
        validate_structured_outputs(constraint)
    with pytest.raises(ValueError, match=problem):
        llm.generate([PROMPT], _sampled(constraint), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    assert StructuredOutputsParams(choice=["a"]).kind == "choice"


def test_a_slow_grammar_does_not_stall_other_requests(llm, monkeypatch):
    manager = llm.llm_engine._structured_output_manager()
    release = threading.Event()
    compile_grammar = manager._compile

    def slow_compile(grammar: str):
        release.wait(30)   # a schema that takes long to compile
        return compile_grammar(grammar)
    monkeypatch.setattr(manager, "_compile", slow_compile)
    engine = llm.llm_engine
    slow = StructuredOutputsParams(regex=r"slow [0-9]{5}")   # not compiled before: not cached
    engine.add_request("slow", PROMPT, _sampled(slow, seed=0))
    engine.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=4))
    finished = {}
    while "free" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "slow" not in finished and engine.has_unfinished_requests()
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch(r"slow [0-9]{5}", finished["slow"].outputs[0].text)


def test_structural_tag_constrains_the_tagged_segment(llm):
    tag = {"type": "structural_tag", "triggers": ["<fn="],
           "structures": [{"begin": "<fn=add>", "end": "</fn>",
                           "schema": {"type": "object", "required": ["a"], "additionalProperties": False,
                                      "properties": {"a": {"type": "integer"}}}}]}
    constraint = StructuredOutputsParams(structural_tag=json.dumps(tag))
    with pytest.raises(ValueError, match="no trigger starts"):
        validate_structured_outputs(StructuredOutputsParams(structural_tag=json.dumps(
            {**tag, "triggers": ["<other="]})))
    manager = llm.llm_engine._structured_output_manager()
    tokenizer = llm.llm_engine.tokenizer

    def fits(text: str) -> bool:
        grammar = manager.grammar_init(constraint).grammar   # waits for the compilation
        return grammar.matcher.try_consume_tokens(tokenizer.encode(text)) == len(tokenizer.encode(text))
    # Free text around the tagged segment; inside it, only the schema.
    assert fits('Sure, adding. <fn=add>{"a": 12}</fn> done')
    assert not fits('Sure, adding. <fn=add>{"b": 12}')
    assert not fits('<fn=add>{"a": "x"}')
    out = llm.generate([PROMPT], _sampled(constraint, seed=0, max_tokens=8),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason in ("stop", "length")


@pytest.mark.slow   # ~25 s: two worker processes start
def test_tensor_parallel_workers_get_the_bitmask(tmp_path):
    # Two real worker processes over gloo: the step's bitmask reaches both ranks (by value).
    from tests.entrypoints.openai._helpers import write_tiny_checkpoint

    llm = LLM(model=write_tiny_checkpoint(str(tmp_path)), dtype="float32", tensor_parallel_size=2,
              num_gpu_blocks_override=64, max_model_len=256)
    try:
        params = [_sampled(StructuredOutputsParams(regex=r"[a-z]{3} [0-9]{2}"), seed=i,
                           max_tokens=20) for i in range(3)]
        outs = llm.generate(["The quick brown fox"] * 3, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for out in outs:
        assert re.fullmatch(r"[a-z]{3} [0-9]{2}", out.outputs[0].text)


def test_properties_come_in_the_schema_order(llm):
    schema = {"type": "object", "required": ["zeta", "alpha"], "additionalProperties": False,
              "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}}}
    out = llm.generate([PROMPT], _sampled(StructuredOutputsParams(json=schema), seed=0),
                       use_tqdm=False)[0].outputs[0]
    assert list(json.loads(out.text)) == ["zeta", "alpha"]
