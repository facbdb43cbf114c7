"""vLLM's `vllm.v1.sample`: the sampling-side interfaces model authors and plugins code against
(custom logits processors). The sampler itself is `minivllm/worker/sampler.py`."""
