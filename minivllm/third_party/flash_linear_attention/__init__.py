"""`vllm.third_party.flash_linear_attention`: flash-linear-attention's ops as vLLM's files
call them, computed by minivllm's torch rules (`model_executor/layers/mamba/ops/`)."""
