"""Engine metrics in a Prometheus registry (one per engine), with vLLM's metric names under
the `moe:` namespace, and a reader that returns them as plain objects for `LLM.get_metrics()`."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class Metric:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)
    kind: str = "counter"  # "counter", "gauge" or "histogram" (its _count and _sum)


# Latency buckets in seconds (vLLM's, trimmed): fine below a second, coarse up to minutes.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name, doc):
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def gauge(name, doc):
            # Several API processes (prometheus multiprocess mode): the value set last is the state.
            return Gauge(name, doc, labels, registry=self.registry, multiprocess_mode="mostrecent").labels(model_name)

        self.prompt_tokens = counter("moe:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("moe:generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("moe:num_preemptions", "Cumulative number of preemptions.")
        self.prefix_cache_queries = counter("moe:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("moe:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.mm_cache_queries = counter("moe:mm_cache_queries", "Images looked up in the processor cache.")
        self.mm_cache_hits = counter("moe:mm_cache_hits", "Images found in the processor cache (not processed again).")
        self.mm_ipc_cache_queries = counter("moe:mm_ipc_cache_queries",
                                            "Images sent to an engine core through the IPC cache.")
        self.mm_ipc_cache_hits = counter("moe:mm_ipc_cache_hits",
                                         "Images sent as their hash alone (the engine core held their pixels).")
        self.request_success = counter("moe:request_success", "Requests finished.")
        self.num_requests_running = gauge("moe:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("moe:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("moe:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram("moe:time_to_first_token_seconds", "Time to the first token.",
                                             _TTFT_BUCKETS)
        self.inter_token_latency = histogram("moe:inter_token_latency_seconds", "Time between two output tokens.",
                                             _ITL_BUCKETS)
        self.e2e_request_latency = histogram("moe:e2e_request_latency_seconds", "Arrival to the last token.",
                                             _REQUEST_BUCKETS)
        self.request_queue_time = histogram("moe:request_queue_time_seconds",
                                            "Arrival at the engine core to first scheduling.", _REQUEST_BUCKETS)

        # Expert load per MoE layer (and per expert-parallel rank), not per expert: the series
        # count stays sane; the recording and the dashboard have the per-expert view.
        self.expert_load_balancedness = Gauge(
            "moe:expert_load_balancedness", "Mean / max of the per-EP-rank load in the last expert-load window.",
            ["model_name", "layer"], registry=self.registry, multiprocess_mode="mostrecent")
        self.expert_load_tokens = Counter(
            "moe:expert_load_tokens", "Routed (token, expert) slots each expert-parallel rank processed.",
            ["model_name", "layer", "ep_rank"], registry=self.registry)
        self._model_name = model_name

    def observe_expert_load(self, layers: list[int], window: dict, count_totals: bool = True) -> None:
        """One expert-load window (moe/expert_load/recording.py's JSON form) of the MoE layers `layers`."""
        for layer, bal, per_rank in zip(layers, window["balancedness"], window["per_rank"]):
            self.expert_load_balancedness.labels(self._model_name, str(layer)).set(bal)
            if count_totals:
                for rank, n in enumerate(per_rank):
                    self.expert_load_tokens.labels(self._model_name, str(layer), str(rank)).inc(n)

    def snapshot(self) -> list[Metric]:
        out = []
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith(("_created", "_bucket")):
                    continue
                name = s.name[:-len("_total")] if family.type == "counter" and s.name.endswith("_total") else s.name
                out.append(Metric(name, float(s.value), dict(s.labels), family.type))
        return out
