"""LoadConfig and DeviceConfig."""

from dataclasses import dataclass, field

import torch

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class LoadConfig:
    load_format: str = "auto"
    model_loader_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")


@dataclass
class DeviceConfig:
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be one of cpu, cuda, auto; got {self.device!r}")
