"""Prometheus metrics of one server, under vLLM's metric names, in a registry of its own."""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily

from minivllm.engine.async_llm import AsyncLLM

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Gauges read the engine's published snapshot at scrape time; the rest is fed by the loop.

    A registry per instance (not prometheus_client's global one) so that several servers can
    live in one process, as they do in the tests.
    """

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)

        def gauge(name: str, doc: str, read) -> None:
            Gauge(name, doc, names, registry=self.registry).labels(**labels).set_function(read)

        gauge("vllm:num_requests_running", "Sequences in the running batch.",
              lambda: async_llm.stats.num_running)
        gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled (queued).",
              lambda: async_llm.num_queued)
        gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
              lambda: async_llm.stats.kv_cache_usage)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", names,
                                     registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", names,
                                         registry=self.registry).labels(**labels)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", names,
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive token outputs of a request.", names,
                             buckets=_ITL_BUCKETS, registry=self.registry).labels(**labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             names, buckets=_E2E_BUCKETS, registry=self.registry).labels(**labels)
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                names + ["finished_reason"], registry=self.registry)
        self._labels = labels
        self.registry.register(_SpecDecodingCollector(async_llm, model_name))
        async_llm.stat_loggers.append(self)

    # StatLogger interface (called from the engine loop thread; prometheus_client is thread-safe).

    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_new_tokens(self, num_new_tokens: int, ttft_s: float | None, itl_s: float | None) -> None:
        self.generation_tokens.inc(num_new_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if itl_s is not None:
            self.itl.observe(itl_s)

    def on_request_finished(self, finish_reason: str, e2e_s: float) -> None:
        self._success.labels(**self._labels, finished_reason=finish_reason).inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecDecodingCollector:
    """vLLM's speculative-decoding counters, read from the engine's snapshot at scrape time
    (nothing when the engine does not speculate)."""

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.async_llm = async_llm
        self.model_name = model_name

    def collect(self):
        stats = self.async_llm.stats.spec_decoding
        if stats is None:
            return
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Draft sequences verified.", stats.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                 stats.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 stats.num_accepted_tokens)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     labels=["model_name", "position"])
        for pos, value in enumerate(stats.num_accepted_tokens_per_pos):
            family.add_metric([self.model_name, str(pos)], value)
        yield family
