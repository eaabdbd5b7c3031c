"""Prometheus metrics (vLLM's names with a `jvllm:` prefix) on a private registry, labelled by model."""
from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jvllm.engine.async_engine import AsyncEngine
from jvllm.outputs import RequestOutput
from jvllm.worker.compile_watch import compile_watch

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class _EngineStateCollector(Collector):
    """Gauges read from the engine's published stats at scrape time (the engine thread owns the truth)."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats
        for name, doc, value in (
                ("jvllm:num_requests_running", "Sequences in the running batch.", stats.num_running),
                ("jvllm:num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting),
                ("jvllm:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full).", stats.kv_cache_usage)):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, doc, value in (
                ("jvllm:xla_compilations", "XLA executables compiled (or loaded) after start-up: every step shape "
                                           "is compiled at start, so this stays 0 unless something is wrong.",
                 compile_watch().unexpected),
                ("jvllm:num_preemptions", "Preemptions (recompute) so far.", stats.num_preemptions),
                ("jvllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 stats.prefix_cache_queries),
                ("jvllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        if stats.spec_decode_accepted_per_position is not None:
            yield from self._spec_decode(stats)

    def _spec_decode(self, stats):
        """Speculative decoding's counters, as vLLM's spec_decode metrics (an engine that speculates only)."""
        for name, doc, value in (
                ("jvllm:spec_decode_num_drafts", "Verification steps of requests with draft tokens.",
                 stats.spec_decode_num_drafts),
                ("jvllm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                 stats.spec_decode_num_draft_tokens),
                ("jvllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 stats.spec_decode_num_accepted_tokens)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily("jvllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft (0: the first).",
                                     labels=["model_name", "position"])
        for position, value in enumerate(stats.spec_decode_accepted_per_position):
            family.add_metric([self.model_name, str(position)], value)
        yield family
        for name, doc, value in (
                ("jvllm:spec_decode_acceptance_rate", "Accepted draft tokens over proposed ones so far.",
                 stats.spec_decode_num_accepted_tokens / max(stats.spec_decode_num_draft_tokens, 1)),
                ("jvllm:spec_decode_mean_accepted_length", "Tokens a verification step emits on average (accepted "
                 "drafts plus the token sampled after them).",
                 1 + stats.spec_decode_num_accepted_tokens / max(stats.spec_decode_num_drafts, 1))):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


@dataclasses.dataclass
class _Progress:
    generated: int = 0
    last_token_time: float | None = None


class ServerMetrics:
    """Owns the registry; `observe` is an AsyncEngine output observer (called once per step per request)."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        disable_created_metrics()  # process-wide, as in vLLM: no `_created` series next to every counter
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStateCollector(engine, model_name))
        labels = {"model_name": model_name}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ["model_name", *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(**labels)

        self.prompt_tokens = counter("jvllm:prompt_tokens", "Prefilled prompt tokens.").labels(**labels)
        self.generation_tokens = counter("jvllm:generation_tokens", "Generated tokens.").labels(**labels)
        self._success = counter("jvllm:request_success", "Finished requests by finish reason.",
                                ("finished_reason",))
        self.model_name = model_name
        self.ttft = histogram("jvllm:time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("jvllm:inter_token_latency_seconds", "Time between token steps.", _ITL_BUCKETS)
        self.e2e = histogram("jvllm:e2e_request_latency_seconds", "Arrival to finish (stop or length).",
                             _LATENCY_BUCKETS)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name=model_name, finished_reason=reason)  # present at 0 from the start
        self._progress: dict[str, _Progress] = {}

    def observe(self, output: RequestOutput) -> None:
        progress = self._progress.setdefault(output.request_id, _Progress())
        generated = sum(len(o.token_ids) for o in output.outputs)
        metrics = output.metrics
        if generated > progress.generated:
            if progress.generated == 0:
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                if metrics is not None and metrics.time_to_first_token is not None:
                    self.ttft.observe(metrics.time_to_first_token)
            elif metrics is not None and metrics.last_token_time and progress.last_token_time:
                self.itl.observe(max(metrics.last_token_time - progress.last_token_time, 0.0))
            self.generation_tokens.inc(generated - progress.generated)
            progress.generated = generated
            progress.last_token_time = metrics.last_token_time if metrics else None
        if output.finished:
            del self._progress[output.request_id]
            reasons = [o.finish_reason or "abort" for o in output.outputs]
            reason = "abort" if "abort" in reasons else reasons[0]  # one count per request, as vLLM
            self._success.labels(model_name=self.model_name, finished_reason=reason).inc()
            if reason != "abort" and metrics is not None and metrics.finished_time:
                self.e2e.observe(metrics.finished_time - metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
