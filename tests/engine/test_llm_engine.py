"""LLMEngine end to end over a fake executor that emits scripted tokens."""

from types import SimpleNamespace

import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput

SCRIPTS = ["Hello world, the quick brown fox", " jumps over the lazy dog.", " Café 中文 🙂 ok"]


class FakeExecutor:
    """Follows the scheduler's deltas like a runner; child i of any request emits SCRIPTS[i]
    (then eos). Logprobs: the sampled token at rank 1 with logprob -0.5, then token 3."""

    def __init__(self, tokenizer, num_blocks=64):
        self.num_blocks = num_blocks
        self.scripts = [tokenizer.encode(s) + [tokenizer.eos_token_id] for s in SCRIPTS]
        self.states: dict[str, dict] = {}
        self.calls: list[SchedulerOutput] = []

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.calls.append(so)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            index = int(new.req_id.split("_")[0]) if "_" in new.req_id else 0
            self.states[new.req_id] = dict(tokens=new.prompt_token_ids + new.output_token_ids,
                                           prompt=new.prompt_token_ids, params=new.sampling_params,
                                           script=self.scripts[index],
                                           num_out=len(new.output_token_ids),
                                           computed=new.num_computed_tokens)
        out = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.states[req_id]
            start, state["computed"] = state["computed"], state["computed"] + n
            out.req_ids.append(req_id)
            if state["params"].prompt_logprobs is not None:
                prompt = state["prompt"]
                out.prompt_logprobs[req_id] = [[(prompt[p + 1], -1.0, 2), (3, -0.1, 1)]
                                               for p in range(start, min(start + n, len(prompt) - 1))]
            token = None
            if state["computed"] == len(state["tokens"]):
                token = state["script"][min(state["num_out"], len(state["script"]) - 1)]
                state["num_out"] += 1
                state["tokens"].append(token)
            out.sampled_token_ids.append([token] if token is not None else [])
            want = state["params"].logprobs
            out.logprobs.append(None if want is None or token is None
                                else [[(token, -0.5, 1)] + [(token, -0.5, 1), (3, -1.5, 2)][:want]])
        return out


def make_engine(tokenizer, max_num_batched_tokens=8, max_model_len=64, num_blocks=64):
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens),
        cache_config=SimpleNamespace(block_size=4, enable_prefix_caching=True),
        model_config=SimpleNamespace(max_model_len=max_model_len))
    executor = FakeExecutor(tokenizer, num_blocks)
    return LLMEngine(config, executor, tokenizer), executor


def run(engine):
    final, steps = {}, []
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps.append(outs)
        for out in outs:
            assert out.request_id not in final, "output after finish"
            if out.finished:
                final[out.request_id] = out
    return final, steps


def test_generate_until_eos_with_outputs_shape(tokenizer):
    engine, _ = make_engine(tokenizer)
    engine.add_request("a", "Hello world", SamplingParams(max_tokens=100))
    final, steps = run(engine)
    out = final["a"]
    assert out.prompt == "Hello world" and out.prompt_token_ids == tokenizer.encode("Hello world")
    (completion,) = out.outputs
    assert completion.index == 0 and completion.text == SCRIPTS[0]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.token_ids[-1] == tokenizer.eos_token_id
    assert completion.logprobs is None and completion.cumulative_logprob is None
    assert all(not o.finished for s in steps[:-1] for o in s)


def test_max_tokens_and_n_fan_out(tokenizer):
    engine, executor = make_engine(tokenizer, max_num_batched_tokens=32)
    engine.add_request("r", [5, 6, 7], SamplingParams(n=3, max_tokens=4, seed=1))
    assert engine.get_num_unfinished_requests() == 1
    final, _ = run(engine)
    out = final["r"]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.prompt is None
    seen = {new.req_id: new.sampling_params.seed
            for so in executor.calls for new in so.scheduled_new_reqs}
    assert seen == {"0_r": 1, "1_r": 2, "2_r": 3}
    for i, c in enumerate(out.outputs):
        assert c.finish_reason == "length" and len(c.token_ids) == 4
        assert c.token_ids == tokenizer.encode(SCRIPTS[i])[:4]
        # A character cut by the length cap is never emitted (as in vLLM).
        assert c.text == tokenizer.decode(c.token_ids).rstrip("\ufffd")


def test_stop_string_finishes_and_frees(tokenizer):
    engine, executor = make_engine(tokenizer)
    engine.add_request("s", "Hi", SamplingParams(max_tokens=100, stop=["quick"]))
    final, steps = run(engine)
    (c,) = final["s"].outputs
    assert c.text == "Hello world, the " and c.finish_reason == "stop" and c.stop_reason == "quick"
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 64
    for outs in steps:
        for o in outs:
            assert not o.outputs[0].text.endswith(("q", "qu", "qui", "quic"))
    engine.add_request("next", [1, 2], SamplingParams(max_tokens=1))
    engine.step()
    assert "s" in executor.calls[-1].finished_req_ids


def test_abort(tokenizer):
    engine, executor = make_engine(tokenizer)
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=3))
    engine.step()
    engine.abort_request("a")
    engine.abort_request(["missing"])
    final, _ = run(engine)
    assert set(final) == {"b"}
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 64
    assert any("a" in so.finished_req_ids for so in executor.calls)
    assert engine.step() == []


def test_logprobs_and_prompt_logprobs(tokenizer):
    engine, _ = make_engine(tokenizer, max_num_batched_tokens=4)
    prompt = tokenizer.encode("the lazy dog jumps")
    engine.add_request("p", prompt, SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1))
    (c,) = (out := run(engine)[0]["p"]).outputs
    assert len(c.logprobs) == 3 and c.cumulative_logprob == pytest.approx(-1.5)
    first = c.logprobs[0]
    assert set(first) == {c.token_ids[0], 3} and first[c.token_ids[0]].rank == 1
    assert first[3].decoded_token == tokenizer.decode([3])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert all(pl[prompt[i + 1]].logprob == -1.0 for i, pl in enumerate(out.prompt_logprobs[1:]))


def test_prefix_cache_hits_are_reported(tokenizer):
    engine, _ = make_engine(tokenizer, max_num_batched_tokens=64)
    prompt = list(range(10, 30))
    engine.add_request("a", prompt, SamplingParams(max_tokens=2))
    run(engine)
    engine.add_request("b", prompt, SamplingParams(max_tokens=2))
    assert run(engine)[0]["b"].num_cached_tokens == 16


def test_invalid_requests(tokenizer):
    engine, _ = make_engine(tokenizer, max_model_len=8, num_blocks=4)
    with pytest.raises(ValueError, match="9 tokens.*max_model_len=8"):
        engine.add_request("long", list(range(9)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [])
    engine.add_request("x", [1], SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [1])
    # max_tokens=None runs until max_model_len.
    assert len(run(engine)[0]["x"].outputs[0].token_ids) == 7


def test_add_request_takes_vllm_prompt_dicts(tokenizer):
    engine, _ = make_engine(tokenizer)
    engine.add_request("text", {"prompt": "Hello world"}, SamplingParams(max_tokens=100))
    engine.add_request("ids", {"prompt_token_ids": (5, 6, 7)}, SamplingParams(max_tokens=3))
    final, _ = run(engine)
    assert final["text"].prompt == "Hello world"
    assert final["text"].prompt_token_ids == tokenizer.encode("Hello world")
    assert final["ids"].prompt_token_ids == [5, 6, 7]
    for bad, match in [({"text": "x"}, "'prompt', 'prompt_token_ids' or 'prompt_embeds'"),
                       (3.5, "Unsupported")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", bad, SamplingParams())
    assert not engine.has_unfinished_requests()
