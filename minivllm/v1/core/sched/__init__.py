"""minivllm.v1.core.sched."""
