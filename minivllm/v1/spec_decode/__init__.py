"""Speculative decoding: proposers and their statistics (vLLM keeps them in `v1/spec_decode/`)."""
