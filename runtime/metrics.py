"""The ``/metrics`` of ``multilora serve``: Prometheus text format, one registry per app.

Per request (counted when it ends): ``multilora_requests_total{adapter, finish_reason}`` (``adapter`` = the request's
``model``: an adapter name or the base model's served name) and the latency histograms
``multilora_time_to_first_token_seconds``, ``multilora_time_per_output_token_seconds`` (a request's mean gap between
its tokens) and ``multilora_e2e_request_latency_seconds``, from ``RequestOutput``'s times.

Read from ``Engine.stats()`` at each scrape: ``multilora_engine_up`` (1 while the engine's loop runs; 0 once it has
stopped, as ``/health``'s 503; when its stats cannot be read either, an engine process that died, only the
per-request metrics come with it: the scrape itself still succeeds),
``multilora_kv_blocks{state="total"|"free"}``, ``multilora_adapters
{tier}``, ``multilora_adapter_bytes_moved_total{source, destination}``, ``multilora_prompt_tokens_total``,
``multilora_generation_tokens_total``, ``multilora_preemptions_total``, the histogram
``multilora_step_duration_seconds{kind}`` (engine steps by kind), ``multilora_kernel_compiles_total`` /
``multilora_kernel_compile_seconds_total`` (CUDA); and the model-server protocol metrics that the
Kubernetes Gateway API inference extension reads for adapter-affinity routing, named exactly as vLLM names them:
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:gpu_cache_usage_perc`` (KV blocks used / total,
0..1) and ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`` (comma-separated adapter
names; the value is the scrape's Unix time, as vLLM sets it).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from multilora.runtime.postprocess import RequestOutput

log = logging.getLogger("multilora.server")

# vLLM's buckets (seconds)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0)
#: Engine.stats() keys of the adapter bytes moved, as (source tier, destination tier)
_MOVES = {"bytes_disk_to_host": ("disk", "host"), "bytes_host_to_gpu": ("host", "gpu"),
          "bytes_gpu_to_host": ("gpu", "host")}


def _le(bound: float) -> str:
    return f"{bound:.6g}"


class ServerMetrics:
    """The app's metrics (its own ``CollectorRegistry``).

    Args:
        engine: read at each scrape (``Engine.stats()``).
        served_model_name: the ``model_name`` label of the ``vllm:`` gauges.
        running: whether the engine's loop runs (the server's liveness, as ``/health``); None: always.
    """

    def __init__(self, engine: Any, served_model_name: str, running: Callable[[], bool] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("multilora_requests", "requests ended, by adapter and finish reason",
                                ["adapter", "finish_reason"], registry=self.registry)
        self.ttft = Histogram("multilora_time_to_first_token_seconds", "time to first token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("multilora_time_per_output_token_seconds", "mean time between a request's tokens",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("multilora_e2e_request_latency_seconds", "arrival to finish",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine, served_model_name, running))

    def observe(self, adapter: str, finish_reason: str, out: RequestOutput | None = None) -> None:
        """Count one ended request; its latencies when ``out`` (its ``RequestOutput``) is known."""
        self.requests.labels(adapter, finish_reason).inc()
        if out is None or out.arrival_time is None or out.finish_time is None:
            return
        self.e2e.observe(out.finish_time - out.arrival_time)
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
            if len(out.token_ids) > 1:
                self.tpot.observe((out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _EngineCollector:
    """The gauges and counters read from ``Engine.stats()`` when scraped (a custom collector: the values are the
    engine's own, and the ``vllm:`` names come out exactly as written)."""

    def __init__(self, engine: Any, served_model_name: str, running: Callable[[], bool] | None = None) -> None:
        self.engine, self.model_name, self.running = engine, served_model_name, running
        self._down: str | None = None  # why the last scrape could not read the engine's stats (said once)

    def describe(self) -> list:
        return []  # no registration-time scrape

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("multilora_engine_up", "1 while the engine's loop runs, 0 once it has stopped (as "
                               "/health's 503: an engine process that died, a loop that stopped)")
        running = self.running is None or self.running()
        try:
            s = self.engine.stats()
        except RuntimeError as e:  # an engine process that died (EngineDeadError) or was closed: up 0, the scrape
            why = f"{type(e).__name__}: {e}"  # still succeeds with the request metrics; another error is a bug (500)
            if why != self._down:  # said once, not at every scrape
                log.warning("/metrics: the engine's stats cannot be read (%s); multilora_engine_up is 0", why)
                self._down = why
            up.add_metric([], 0)
            yield up
            return
        self._down = None
        up.add_metric([], 1 if running else 0)
        yield up
        total, free = s["kv_blocks_total"], s["kv_blocks_free"]
        yield from self._vllm(s, (total - free) / total if total else 0.0)
        kv = GaugeMetricFamily("multilora_kv_blocks", "KV-cache blocks (the reserved null block excluded)",
                               labels=["state"])
        kv.add_metric(["total"], total)
        kv.add_metric(["free"], free)
        yield kv
        tiers = GaugeMetricFamily("multilora_adapters", "loaded adapters per tier", labels=["tier"])
        for tier, n in s["adapters_per_tier"].items():
            tiers.add_metric([tier], n)
        yield tiers
        moved = CounterMetricFamily("multilora_adapter_bytes_moved", "adapter bytes moved between tiers",
                                    labels=["source", "destination"])
        for key, (src, dst) in _MOVES.items():
            moved.add_metric([src, dst], s[key])
        yield moved
        for name, key, doc in (("multilora_prompt_tokens", "prompt_tokens", "prompt tokens prefilled"),
                               ("multilora_generation_tokens", "generated_tokens", "tokens generated"),
                               ("multilora_preemptions", "preemptions", "requests preempted (recomputed later)")):
            yield CounterMetricFamily(name, doc, value=s[key])
        steps = s.get("step_seconds") or {}
        if steps:
            h = HistogramMetricFamily("multilora_step_duration_seconds", "engine step wall time, by step kind "
                                      "(prefill, decode, mixed): a slow step stalls every running request",
                                      labels=["kind"])
            for kind, r in steps.items():
                h.add_metric([kind], [(_le(le), n) for le, n in r["buckets"]] + [("+Inf", r["count"])], r["sum"])
            yield h
        if s.get("kernel_compiles") is not None:  # a compile during serving stalls every running request
            yield CounterMetricFamily("multilora_kernel_compiles", "Triton kernel variants compiled by this process",
                                      value=s["kernel_compiles"])
            yield CounterMetricFamily("multilora_kernel_compile_seconds", "wall seconds of those compiles",
                                      value=s["kernel_compile_seconds"])

    def _vllm(self, s: dict, kv_usage: float) -> Iterator[Metric]:
        """The Gateway API inference extension's model-server protocol metrics, as vLLM exports them."""
        for name, value, doc in (("vllm:num_requests_running", s["running"], "requests running"),
                                 ("vllm:num_requests_waiting", s["waiting"], "requests waiting"),
                                 ("vllm:gpu_cache_usage_perc", kv_usage, "KV-cache usage (blocks used / total, 0..1)")):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        info = GaugeMetricFamily("vllm:lora_requests_info", "running and waiting adapters (value: Unix time)",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(s["pool_max_rank_adapters"]), ",".join(s["running_adapters"]),
                         ",".join(s["waiting_adapters"])], time.time())
        yield info
