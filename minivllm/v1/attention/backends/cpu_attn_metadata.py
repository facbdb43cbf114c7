"""NOTE(temporary): removed once the kernel tests import the backend's real home."""
from minivllm.model_executor.layers.attention.backends.cpu_attn_metadata import *  # noqa: F401,F403
from minivllm.model_executor.layers.attention.backends.cpu_attn_metadata import TorchAttentionMetadataBuilder  # noqa: F401
