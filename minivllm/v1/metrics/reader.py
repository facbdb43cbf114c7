"""The metric snapshot `LLM.get_metrics()` returns: vLLM's reader types, plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metric:
    """A named metric with its Prometheus labels (model_name, ...)."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    """A counter per index (vLLM's: acceptances per draft position)."""

    values: list[int] = field(default_factory=list)
