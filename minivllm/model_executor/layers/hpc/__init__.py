"""vLLM's HPC fused-kernel layers (`layers.hpc`), as far as model files reach for them: the
fused RoPE + QK-norm + KV-write op's support check, which says no (see `rope_norm.py`)."""

from minivllm.model_executor.layers.hpc.rope_norm import HpcRopeNorm, QkNormPolicy

__all__ = ["HpcRopeNorm", "QkNormPolicy"]
