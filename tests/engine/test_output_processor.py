"""process_child: several tokens of one step (a verified draft) through logprobs, text and stop
strings; a stop string inside them drops the tokens after it."""

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.output_processor import ChildState, ParentState, process_child
from minivllm.engine.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams


def _child(tokenizer, params: SamplingParams, prompt: list[int]) -> ChildState:
    request = Request("r", prompt, params, eos_token_id=tokenizer.eos_token_id)
    parent = ParentState("r", None, prompt)
    child = ChildState(request, parent, 0, IncrementalDetokenizer(tokenizer, prompt, params))
    child.logprobs, child.cumulative_logprob = [], 0.0
    return child


def test_stop_string_inside_a_step_drops_the_tokens_after_it(tokenizer):
    prompt = tokenizer.encode("Hello")
    words = [tokenizer.encode(w) for w in (" world,", " the quick", " brown fox")]
    step = [t for w in words for t in w]
    child = _child(tokenizer, SamplingParams(stop=["quick"], logprobs=0), prompt)
    child.request.append_output_token_ids(step)
    lps = [[(t, -0.5, 1)] for t in step]
    assert process_child(child, lps, tokenizer) == "quick"
    kept = child.request.output_token_ids
    # The tokens end with the one that completed "quick"; none of " brown fox" remains.
    assert "quick" in tokenizer.decode(kept) and "brown" not in tokenizer.decode(kept)
    assert kept == step[:len(kept)] and len(kept) < len(step)
    assert child.detokenizer.output_text == " world, the "
    assert len(child.logprobs) == len(kept) and child.cumulative_logprob == -0.5 * len(kept)


def test_eos_ending_a_step_stays_out_of_the_text(tokenizer):
    prompt = tokenizer.encode("Hello")
    step = tokenizer.encode(" world") + [tokenizer.eos_token_id]
    child = _child(tokenizer, SamplingParams(), prompt)
    child.request.append_output_token_ids(step)
    child.request.status = RequestStatus.FINISHED_STOPPED
    assert process_child(child, None, tokenizer) is None
    assert child.detokenizer.output_text == " world" and child.request.output_token_ids == step
    assert child.num_processed_tokens == len(step)
