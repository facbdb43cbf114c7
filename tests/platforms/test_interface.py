"""Platforms: the CPU answers from the host; the CUDA one from torch.cuda (faked here: no GPU)."""

import pytest
import torch

import minivllm.platforms as platforms
from minivllm.platforms import DeviceCapability, PlatformEnum
from minivllm.platforms.cpu import CpuPlatform
from minivllm.platforms.cuda import CudaPlatform


def test_device_capability():
    cap = DeviceCapability(8, 9)
    assert cap.to_int() == 89 and cap.as_version_str() == "8.9" and cap >= (8, 0)


def test_cpu_platform():
    cpu = CpuPlatform()
    assert cpu.is_cpu() and not cpu.is_cuda() and not cpu.is_cuda_alike()
    assert (cpu.device_type, cpu.dispatch_key, cpu.dist_backend) == ("cpu", "CPU", "gloo")
    assert cpu.get_device_capability() is None and not cpu.has_device_capability(70)
    assert not cpu.is_device_capability((9, 0)) and not cpu.supports_fp8()
    assert cpu.fp8_dtype() == torch.float8_e4m3fn and cpu.use_all_gather()
    assert cpu.get_device_total_memory() > 2**28 and cpu.get_device_name()
    cpu.seed_everything(7)
    first = torch.rand(3)
    cpu.seed_everything(7)
    assert torch.equal(first, torch.rand(3))


def test_cuda_platform_answers_from_torch_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=0: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=0: "Fake GPU")
    cuda = CudaPlatform()
    assert cuda.is_cuda() and cuda.is_cuda_alike() and cuda._enum == PlatformEnum.CUDA
    assert cuda.get_device_capability() == DeviceCapability(8, 6)
    assert cuda.has_device_capability(80) and cuda.has_device_capability((8, 6))
    assert not cuda.has_device_capability(89) and not cuda.supports_fp8()
    assert cuda.is_device_capability(86) and cuda.get_device_name() == "Fake GPU"
    assert (cuda.dispatch_key, cuda.dist_backend) == ("CUDA", "nccl")


@pytest.mark.parametrize(("gpu", "expected"), [(False, CpuPlatform), (True, CudaPlatform)])
def test_current_platform_is_resolved_once(monkeypatch, gpu, expected):
    monkeypatch.setattr(platforms, "_current_platform", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.version, "hip", None)
    current = platforms.current_platform
    assert type(current) is expected and platforms.current_platform is current
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        platforms.nope  # noqa: B018
