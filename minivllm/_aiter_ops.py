"""`rocm_aiter_ops` (vLLM's `_aiter_ops`): the switches of AMD's ROCm AITER kernel library, which
model files ask before choosing a kernel-specific layout. minivllm runs no AITER kernels (CPU,
and CUDA through PyTorch), so every switch reads off and the files take their portable path."""


class RocmAiterOps:
    """Each `is_*_enabled` says whether an AITER kernel family is in use: never here."""

    @staticmethod
    def is_enabled() -> bool:
        return False

    @staticmethod
    def is_fused_moe_enabled() -> bool:
        return False

    @staticmethod
    def is_fusion_moe_shared_experts_enabled() -> bool:
        return False


rocm_aiter_ops = RocmAiterOps()
