"""`CudaPlatform`: an NVIDIA GPU, answered by torch.cuda."""

import torch

from minivllm.platforms.interface import DeviceCapability, Platform, PlatformEnum


class CudaPlatform(Platform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dispatch_key = "CUDA"
    dist_backend = "nccl"

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major, minor)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.cuda.get_device_properties(device_id).total_memory

    @classmethod
    def supports_fp8(cls) -> bool:
        # fp8 tensor-core matmuls: Ada (8.9) and newer.
        return cls.has_device_capability(89)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return True

    @classmethod
    def seed_everything(cls, seed: int | None = None) -> None:
        super().seed_everything(seed)
        if seed is not None:
            torch.cuda.manual_seed_all(seed)
