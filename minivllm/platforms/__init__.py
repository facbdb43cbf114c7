"""`current_platform`: the device this process computes on, resolved on first use.

CUDA when torch sees an NVIDIA GPU (`torch.cuda.is_available()` and not a ROCm build), else
CPU. Which device the engine runs on is still `--device` (`DeviceConfig`); this answers vLLM's
hardware questions (`is_cuda()`, `get_device_capability()`, `fp8_dtype()`, ...).
"""

from typing import TYPE_CHECKING, Any

from minivllm.platforms.interface import CpuArchEnum, DeviceCapability, Platform, PlatformEnum

if TYPE_CHECKING:
    current_platform: Platform

__all__ = ["CpuArchEnum", "DeviceCapability", "Platform", "PlatformEnum", "current_platform"]

_current_platform: Platform | None = None


def _resolve_platform() -> Platform:
    import torch

    if torch.cuda.is_available() and torch.version.hip is None:
        from minivllm.platforms.cuda import CudaPlatform
        return CudaPlatform()
    from minivllm.platforms.cpu import CpuPlatform
    return CpuPlatform()


def __getattr__(name: str) -> Any:
    global _current_platform
    if name == "current_platform":
        if _current_platform is None:
            _current_platform = _resolve_platform()
        return _current_platform
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
