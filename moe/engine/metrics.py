"""Engine metrics in a Prometheus registry (one per engine), with vLLM v1's metric names, labels
and buckets (vllm/v1/metrics/loggers.py) under the `moe:` namespace instead of `vllm:`, and a
reader that returns them as plain objects for `LLM.get_metrics()`. docs/metrics.md lists them."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class Metric:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)
    kind: str = "counter"  # "counter", "gauge" or "histogram" (its _count and _sum)


@dataclass
class FinishedRequestStats:
    """One finished sequence (a request of n > 1 counts n times, as in vLLM). The times are in
    seconds; None where not measured (latencies off, or never scheduled / no token)."""
    finished_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None = None
    e2e: float | None = None          # arrival to finish
    prefill: float | None = None      # first scheduling to the first token
    decode: float | None = None       # first token to the last
    inference: float | None = None    # first scheduling to the last token


# vLLM's FinishReason values ("error": a failed step finished the request).
FINISHED_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets. Latencies in seconds; inter-token latency with two finer ones below 10 ms.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_DEFAULT_MAX_MODEL_LEN = 1_000_000  # token-count buckets when the context length is not known


def observe_repeated(histogram, value: float, count: int) -> None:
    """histogram.observe(value) `count` times, as one update of its sum and bucket. A step's
    inter-token gaps are mostly one value (every request decoding in consecutive steps has the
    same gap), and prometheus-client's observe costs microseconds a call: at 256 running requests
    the per-token loop was a third of the output side's host time. Uses the labelled child's
    value fields (prometheus-client >= 0.17); where they are missing, observes one by one."""
    try:
        total, bounds, buckets = histogram._sum, histogram._upper_bounds, histogram._buckets
    except AttributeError:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect.bisect_left(bounds, value)].inc(count)  # the first bound >= value, as observe picks


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class EngineMetrics:
    def __init__(self, model_name: str, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        labels = ["model_name"]

        def counter(name, doc):
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def gauge(name, doc):
            # Several API processes (prometheus multiprocess mode): the value set last is the state.
            return Gauge(name, doc, labels, registry=self.registry, multiprocess_mode="mostrecent").labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        # ---- scheduler state and totals
        self.num_requests_running = gauge("moe:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("moe:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("moe:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.num_preemptions = counter("moe:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = counter("moe:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("moe:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        # ---- images
        self.mm_cache_queries = counter("moe:mm_cache_queries", "Images looked up in the processor cache.")
        self.mm_cache_hits = counter("moe:mm_cache_hits", "Images found in the processor cache (not processed again).")
        self.mm_ipc_cache_queries = counter("moe:mm_ipc_cache_queries",
                                            "Images sent to an engine core through the IPC cache.")
        self.mm_ipc_cache_hits = counter("moe:mm_ipc_cache_hits",
                                         "Images sent as their hash alone (the engine core held their pixels).")
        # ---- tokens and requests
        self.prompt_tokens = counter("moe:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("moe:generation_tokens", "Number of generation tokens processed.")
        success = Counter("moe:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=self.registry)
        # Every reason's series exists from the start (at 0), as in vLLM: rate() sees the first one.
        self._request_success = success
        self.request_success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        self.iteration_tokens = histogram("moe:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", _ITERATION_TOKEN_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len or _DEFAULT_MAX_MODEL_LEN)
        self.request_prompt_tokens = histogram("moe:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("moe:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "moe:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self.request_params_n = histogram("moe:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.request_params_max_tokens = histogram("moe:request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", token_buckets)
        # ---- latencies
        self.time_to_first_token = histogram("moe:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("moe:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.request_time_per_output_token = histogram(
            "moe:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            _ITL_BUCKETS)
        self.e2e_request_latency = histogram("moe:e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram("moe:request_queue_time_seconds",
                                            "Histogram of time spent in WAITING phase for request.", _REQUEST_BUCKETS)
        self.request_inference_time = histogram("moe:request_inference_time_seconds",
                                                "Histogram of time spent in RUNNING phase for request.",
                                                _REQUEST_BUCKETS)
        self.request_prefill_time = histogram("moe:request_prefill_time_seconds",
                                              "Histogram of time spent in PREFILL phase for request.", _REQUEST_BUCKETS)
        self.request_decode_time = histogram("moe:request_decode_time_seconds",
                                             "Histogram of time spent in DECODE phase for request.", _REQUEST_BUCKETS)

        # ---- expert load (this engine's own), per MoE layer (and per expert-parallel rank), not
        # per expert: the series count stays sane; the recording and the dashboard have the per-expert view.
        self.expert_load_balancedness = Gauge(
            "moe:expert_load_balancedness", "Mean / max of the per-EP-rank load in the last expert-load window.",
            ["model_name", "layer"], registry=self.registry, multiprocess_mode="mostrecent")
        self.expert_load_tokens = Counter(
            "moe:expert_load_tokens", "Routed (token, expert) slots each expert-parallel rank processed.",
            ["model_name", "layer", "ep_rank"], registry=self.registry)
        self._cache_config_info: Gauge | None = None

    def set_cache_config_info(self, **info) -> None:
        """moe:cache_config_info: one series at 1 whose labels are the KV-cache configuration
        (block_size, num_gpu_blocks, ...), as vLLM's; set once, when the KV cache is sized."""
        labels = {"model_name": self._model_name, **{k: str(v) for k, v in info.items()}}
        if self._cache_config_info is None:
            self._cache_config_info = Gauge("moe:cache_config_info", "Information of the LLMEngine CacheConfig",
                                            list(labels), registry=self.registry, multiprocess_mode="mostrecent")
        self._cache_config_info.labels(**labels).set(1)

    def observe_finished(self, s: FinishedRequestStats) -> None:
        """One finished sequence: request_success{finished_reason} and the per-request histograms."""
        reason = s.finished_reason
        if reason not in self.request_success:
            self.request_success[reason] = self._request_success.labels(self._model_name, reason)
        self.request_success[reason].inc()
        self.request_prompt_tokens.observe(s.num_prompt_tokens)
        self.request_generation_tokens.observe(s.num_generation_tokens)
        if s.max_tokens is not None:
            self.request_params_max_tokens.observe(s.max_tokens)
        for hist, value in ((self.e2e_request_latency, s.e2e), (self.request_prefill_time, s.prefill),
                            (self.request_decode_time, s.decode), (self.request_inference_time, s.inference)):
            if value is not None:
                hist.observe(value)
        if s.decode is not None:  # vLLM: the decode time over the tokens after the first
            self.request_time_per_output_token.observe(
                s.decode / (s.num_generation_tokens - 1) if s.num_generation_tokens > 1 else 0.0)

    def observe_finished_parent(self, n: int, max_num_generation_tokens: int) -> None:
        """A request all of whose n sequences finished."""
        self.request_params_n.observe(n)
        self.request_max_num_generation_tokens.observe(max_num_generation_tokens)

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
