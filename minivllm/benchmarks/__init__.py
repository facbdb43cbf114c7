"""minivllm.benchmarks."""
