"""The metric snapshot `LLM.get_metrics()` returns: vLLM's reader types, plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


def scheduler_metrics(scheduler: Any, model_name: str) -> list[Metric]:
    """vLLM's offline snapshot (`LLM.get_metrics`) of an engine's scheduler: its gauges,
    preemptions and, when speculating, the draft counters (per position as a Vector)."""
    s = scheduler
    labels = {"model_name": model_name}
    metrics: list[Metric] = [
        Gauge("vllm:num_requests_running", labels, s.num_running),
        Gauge("vllm:num_requests_waiting", labels, s.num_waiting),
        Gauge("vllm:kv_cache_usage_perc", labels, s.kv_cache_usage),
        Counter("vllm:num_preemptions", labels, s.num_preemptions_total)]
    spec = s.spec_stats
    if spec is not None:
        metrics += [Counter("vllm:spec_decode_num_drafts", labels, spec.num_drafts),
                    Counter("vllm:spec_decode_num_draft_tokens", labels, spec.num_draft_tokens),
                    Counter("vllm:spec_decode_num_accepted_tokens", labels,
                            spec.num_accepted_tokens),
                    Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels,
                           list(spec.num_accepted_tokens_per_pos))]
    return metrics
