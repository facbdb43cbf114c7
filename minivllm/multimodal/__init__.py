"""vLLM's multimodal package, as far as text model files import it: minivllm serves vision-
language checkpoints text-only (model_executor/models/text_only.py) and has no multimodal
input processing."""
