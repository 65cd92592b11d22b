"""Engine metrics in a Prometheus registry (one per engine), with vLLM's metric names under
the `moe:` namespace, and a reader that returns them as plain objects for `LLM.get_metrics()`."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass
class Metric:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)
    kind: str = "counter"  # "counter" or "gauge"


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name, doc):
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("moe:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("moe:generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("moe:num_preemptions", "Cumulative number of preemptions.")
        self.prefix_cache_queries = counter("moe:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("moe:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.request_success = counter("moe:request_success", "Requests finished.")
        self.num_requests_running = gauge("moe:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("moe:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("moe:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")

    def snapshot(self) -> list[Metric]:
        out = []
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                name = s.name[:-len("_total")] if family.type == "counter" and s.name.endswith("_total") else s.name
                out.append(Metric(name, float(s.value), dict(s.labels), family.type))
        return out
