"""flash-linear-attention's op modules that vLLM's model files import."""
