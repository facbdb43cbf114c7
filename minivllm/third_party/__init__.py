"""Paths vLLM's model files import from `vllm.third_party` (its vendored kernel libraries);
minivllm's modules there are torch versions of the functions those files call."""
