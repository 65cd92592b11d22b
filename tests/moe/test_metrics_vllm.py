"""The engine's Prometheus metrics carry vLLM v1's names (under `moe:`), labels and histograms, the
offline `LLM.get_metrics()` has its histograms filled, and the Grafana dashboard of docs/ only
queries metrics the engine exports. The built-in tiny-qwen3-moe on CPU."""
from __future__ import annotations

import json
import os
import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moe import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "docs", "grafana", "moe_runtime.json")
MODEL = "tiny-qwen3-moe"

# vLLM v1 (vllm/v1/metrics/loggers.py) name -> its Prometheus type, with `vllm:` -> `moe:`.
VLLM_COUNTERS = ("prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                 "prefix_cache_queries", "prefix_cache_hits", "mm_cache_queries", "mm_cache_hits")
VLLM_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info")
VLLM_HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
                   "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                   "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
                   "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                   "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
                   "iteration_tokens_total")
# Names this engine had before it took vLLM's, or that vLLM itself has dropped: none is exported.
GONE = ("moe:gpu_cache_usage_perc", "moe:time_per_output_token_seconds", "moe:gpu_prefix_cache_queries",
        "moe:gpu_prefix_cache_hits")


@pytest.fixture(scope="module")
def llm():
    llm = LLM(MODEL, device="cpu", max_model_len=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    # "length": three more capped ones, one of them n=2; "stop": the token it would generate first.
    llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], greedy, use_tqdm=False)
    llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(temperature=1.0, n=2, seed=0, max_tokens=3,
                                                              ignore_eos=True), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=4,
                                                                      stop_token_ids=[first]), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "stop"
    # "abort": added, stepped once, aborted.
    llm.llm_engine.add_request("to-abort", {"prompt_token_ids": [1, 2, 3]}, greedy)
    llm.llm_engine.step()
    llm.llm_engine.abort_request("to-abort")
    yield llm
    llm.shutdown()


def _families(llm) -> dict:
    text = generate_latest(llm.llm_engine.metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_vllm_metric_names_types_and_labels(llm):
    fams = _families(llm)
    for name in VLLM_COUNTERS:
        assert fams[f"moe:{name}"].type == "counter", name  # moe:NAME_total on the wire, as vLLM's
    for name in VLLM_GAUGES:
        assert fams[f"moe:{name}"].type == "gauge", name
    for name in VLLM_HISTOGRAMS:
        assert fams[f"moe:{name}"].type == "histogram", name
    assert not set(GONE) & set(fams)
    for fam in fams.values():  # (the expert-load ones have no series: record_expert_load is off)
        assert all(s.labels.get("model_name") == MODEL for s in fam.samples), fam.name
    success = {s.labels["finished_reason"]: s.value for s in fams["moe:request_success"].samples
               if s.name == "moe:request_success_total"}
    # 1 + 2 + 2 (n=2) capped at max_tokens, 1 stopped, 1 aborted.
    assert success == {"length": 5.0, "stop": 1.0, "abort": 1.0, "error": 0.0}
    info = fams["moe:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0


def test_histograms_are_observed(llm):
    fams = _families(llm)

    def sample(family, suffix):
        return next(s.value for s in fams[family].samples if s.name == family + suffix)

    finished = 6  # sequences that ran to their end (the aborted one is only counted in request_success)
    for name in ("e2e_request_latency_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens"):
        assert sample(f"moe:{name}", "_count") == finished, name
    assert sample("moe:request_queue_time_seconds", "_count") == finished + 1  # the aborted one was scheduled
    assert sample("moe:time_to_first_token_seconds", "_count") >= finished
    assert sample("moe:request_params_n", "_count") == 5 and sample("moe:request_params_n", "_sum") == 6
    assert sample("moe:request_max_num_generation_tokens", "_sum") == 4 + 4 + 4 + 3 + 1
    assert sample("moe:request_generation_tokens", "_sum") == 4 + 4 + 4 + 3 + 3 + 1
    assert sample("moe:request_prompt_tokens", "_sum") == 3 + 3 + 2 + 2 + 2 + 3
    assert sample("moe:request_params_max_tokens", "_sum") == 4 * 4 + 3 * 2
    assert sample("moe:inter_token_latency_seconds", "_count") == 3 + 3 + 3 + 2 + 2 + 0
    assert sample("moe:e2e_request_latency_seconds", "_sum") >= sample("moe:time_to_first_token_seconds", "_sum") > 0
    # Every generated and every prompt token (of the sequences that got a first token) in some step.
    steps = sample("moe:iteration_tokens_total", "_sum")
    prompt = next(s.value for s in fams["moe:prompt_tokens"].samples if s.name == "moe:prompt_tokens_total")
    generated = next(s.value for s in fams["moe:generation_tokens"].samples
                     if s.name == "moe:generation_tokens_total")
    assert steps == prompt + generated and sample("moe:iteration_tokens_total", "_count") > 0
    buckets = [s for s in fams["moe:request_params_n"].samples if s.name.endswith("_bucket")]
    assert [s.labels["le"] for s in buckets] == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]


def test_offline_get_metrics_histograms_have_counts(llm):
    """The offline LLM (disable_log_stats=True by default) fills its histograms too."""
    assert llm.llm_engine.args.disable_log_stats
    metrics = {m.name: m for m in llm.get_metrics() if m.kind == "histogram"}
    for name in VLLM_HISTOGRAMS:
        assert metrics[f"moe:{name}_count"].value > 0, name
        assert f"moe:{name}_sum" in metrics, name
    success = [m for m in llm.get_metrics() if m.name == "moe:request_success"]
    assert {m.labels["finished_reason"] for m in success} == {"stop", "length", "abort", "error"}


def _exported_names(llm) -> set[str]:
    """Every series name a query can use: counters with _total, histograms with _bucket/_count/_sum."""
    names = set()
    for fam in llm.llm_engine.metrics.registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(fam.type, ("",))
        names |= {fam.name + s for s in suffixes}
    return names


def test_grafana_dashboard_queries_exported_metrics(llm):
    with open(DASHBOARD) as f:
        dash = json.load(f)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(variables["model_name"]["definition"])
    used = {name for e in exprs for name in re.findall(r"moe:[A-Za-z0-9_:]+", e)}
    exported = _exported_names(llm)
    assert used and used <= exported, sorted(used - exported)
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert 'model_name=~"$model_name"' in t["expr"], t["expr"]
    # The panels the dashboard is for.
    for name in ("moe:request_success_total", "moe:time_to_first_token_seconds_bucket",
                 "moe:inter_token_latency_seconds_bucket", "moe:e2e_request_latency_seconds_bucket",
                 "moe:num_requests_running", "moe:num_requests_waiting", "moe:kv_cache_usage_perc",
                 "moe:generation_tokens_total", "moe:num_preemptions_total", "moe:prefix_cache_hits_total",
                 "moe:expert_load_balancedness"):
        assert name in used, name


@pytest.mark.parametrize("value", [0.0, 0.001, 0.0125, 0.05, 80.0, 1e4], ids=str)
def test_observe_repeated_equals_repeated_observe(value):
    """A step's inter-token gaps go into the histogram as (value, count): the same exposition as
    `count` observe calls, on a bucket bound, between bounds and past the last one."""
    from prometheus_client import CollectorRegistry, Histogram

    from moe.engine.metrics import _ITL_BUCKETS, observe_repeated

    def exposed(record) -> dict:
        registry = CollectorRegistry()
        h = Histogram("itl", "doc", ["model_name"], buckets=_ITL_BUCKETS, registry=registry).labels("m")
        h.observe(0.02)
        record(h)
        text = generate_latest(registry).decode()
        return {(smp.name, smp.labels.get("le")): smp.value for fam in text_string_to_metric_families(text)
                for smp in fam.samples if not smp.name.endswith("_created")}

    batched = exposed(lambda h: observe_repeated(h, value, 7))
    one_by_one = exposed(lambda h: [h.observe(value) for _ in range(7)])
    assert batched.pop(("itl_sum", None)) == pytest.approx(one_by_one.pop(("itl_sum", None)), rel=1e-12)
    assert batched == one_by_one and len(batched) == len(_ITL_BUCKETS) + 2  # buckets, +Inf, count
    assert batched != exposed(lambda h: observe_repeated(h, value, 6))


def test_observe_repeated_without_the_value_fields_observes_one_by_one():
    from moe.engine.metrics import observe_repeated

    class Plain:
        def __init__(self):
            self.seen = []

        def observe(self, v):
            self.seen.append(v)
    h = Plain()
    observe_repeated(h, 0.5, 3)
    assert h.seen == [0.5, 0.5, 0.5]
