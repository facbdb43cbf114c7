"""`CpuPlatform`: minivllm's default, answering from the host."""

import os

import torch

from minivllm.platforms.interface import Platform, PlatformEnum


class CpuPlatform(Platform):
    _enum = PlatformEnum.CPU
    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return _cpu_model_name() or "cpu"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def inference_mode(cls) -> torch.no_grad:
        # As vLLM on CPU: no_grad, since inference tensors cannot be updated in place later.
        return torch.no_grad()


def _cpu_model_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
