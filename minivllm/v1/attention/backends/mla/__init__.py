"""vLLM's MLA backend path: only the sparse (DeepSeek-V3.2) names model files import."""
