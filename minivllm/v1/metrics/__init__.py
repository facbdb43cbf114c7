"""Engine metrics for the offline API (vLLM keeps them in `v1/metrics/`)."""
