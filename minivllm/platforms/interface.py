"""`Platform`: what vLLM's model and layer files ask about the hardware (device kind, GPU
capability, fp8 type, memory); one subclass per device kind, answering from torch."""

import enum
import platform as _py_platform
import random
from typing import NamedTuple

import torch


class PlatformEnum(enum.Enum):
    CUDA = enum.auto()
    ROCM = enum.auto()
    TPU = enum.auto()
    XPU = enum.auto()
    CPU = enum.auto()
    OOT = enum.auto()
    UNSPECIFIED = enum.auto()


class CpuArchEnum(enum.Enum):
    X86 = enum.auto()
    ARM = enum.auto()
    POWERPC = enum.auto()
    S390X = enum.auto()
    RISCV = enum.auto()
    OTHER = enum.auto()
    UNKNOWN = enum.auto()


class DeviceCapability(NamedTuple):
    """A GPU's compute capability, e.g. (9, 0) for an H100."""

    major: int
    minor: int

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        """`major * 10 + minor` (90 for 9.0), the form capability checks compare."""
        return self.major * 10 + self.minor


class Platform:
    _enum: PlatformEnum = PlatformEnum.UNSPECIFIED
    device_name: str = ""
    device_type: str = ""            # torch device string ("cuda", "cpu")
    dispatch_key: str = "CPU"        # torch dispatch key custom ops register under
    dist_backend: str = ""           # torch.distributed backend between ranks
    simple_compile_backend: str = "inductor"

    def is_cuda(self) -> bool:
        return self._enum == PlatformEnum.CUDA

    def is_rocm(self) -> bool:
        return self._enum == PlatformEnum.ROCM

    def is_tpu(self) -> bool:
        return self._enum == PlatformEnum.TPU

    def is_xpu(self) -> bool:
        return self._enum == PlatformEnum.XPU

    def is_cpu(self) -> bool:
        return self._enum == PlatformEnum.CPU

    def is_out_of_tree(self) -> bool:
        return self._enum == PlatformEnum.OOT

    def is_cuda_alike(self) -> bool:
        """CUDA or ROCm: the platforms that run vLLM's CUDA kernels."""
        return self._enum in (PlatformEnum.CUDA, PlatformEnum.ROCM)

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        """None where the device has no compute capability (CPU)."""
        return None

    @classmethod
    def has_device_capability(cls, capability: tuple[int, int] | int,
                              device_id: int = 0) -> bool:
        """Whether the device's capability is at least `capability` ((8, 9) or 89)."""
        current = cls.get_device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current >= capability
        return current.to_int() >= capability

    @classmethod
    def is_device_capability(cls, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = cls.get_device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current == capability
        return current.to_int() == capability

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        raise NotImplementedError

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        """Bytes of device memory."""
        raise NotImplementedError

    @classmethod
    def fp8_dtype(cls) -> torch.dtype:
        """The fp8 type checkpoints and kernels use here (e4m3; ROCm's fnuz variant elsewhere)."""
        return torch.float8_e4m3fn

    @classmethod
    def is_fp8_fnuz(cls) -> bool:
        return False

    @classmethod
    def supports_fp8(cls) -> bool:
        """Whether the hardware multiplies fp8 natively."""
        return False

    @classmethod
    def use_all_gather(cls) -> bool:
        """The vocab-parallel LM head gathers logits with all-gather (not gather to rank 0)."""
        return True

    @classmethod
    def opaque_attention_op(cls) -> bool:
        """Attention runs as one opaque op inside compiled graphs."""
        return True

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls) -> torch.inference_mode:
        return torch.inference_mode(mode=True)

    @classmethod
    def seed_everything(cls, seed: int | None = None) -> None:
        """Seed Python's, NumPy's and torch's generators (all devices)."""
        if seed is None:
            return
        random.seed(seed)
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            np.random.seed(seed)
        torch.manual_seed(seed)

    @classmethod
    def get_cpu_architecture(cls) -> CpuArchEnum:
        machine = _py_platform.machine().lower()
        if machine in ("x86_64", "amd64", "i386", "i686"):
            return CpuArchEnum.X86
        if machine.startswith(("arm", "aarch64")):
            return CpuArchEnum.ARM
        if machine.startswith("ppc"):
            return CpuArchEnum.POWERPC
        if machine == "s390x":
            return CpuArchEnum.S390X
        if machine.startswith("riscv"):
            return CpuArchEnum.RISCV
        return CpuArchEnum.OTHER if machine else CpuArchEnum.UNKNOWN
