"""Lightning / linear-attention layers with a per-sequence recurrent state (vLLM's
`layers.mamba.linear` package)."""
