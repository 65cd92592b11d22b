"""Expert-load recording: the engine's counts against an independent count of the router's
choices, windows, resets and the recording file, and the EPLB arguments' checks (the counting
kernels: tests/kernels/test_expert_count.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.layers.moe import FusedMoE
from moe import LLM, SamplingParams
from moe.config import EngineArgs, EPLBConfig
from moe.expert_load.recording import read_recording

PROMPTS = ["hello world", "the quick brown fox jumps", "a"]
SMALL_KV = dict(kv_cache_memory_bytes=32 << 20)  # on a GPU, several engines share its memory


# ---- the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    # eager: the hooks of the independent count do not run inside a CUDA-graph replay
    return LLM("tiny-qwen3-moe", expert_load_window_steps=3, enforce_eager=True, **SMALL_KV)


def _hooked_counts(llm):
    """An independent count: the router's top-k ids as each FusedMoE receives them."""
    seen: dict[int, list[torch.Tensor]] = {}
    mods = [m for m in llm.llm_engine.core.executor.model.modules() if isinstance(m, FusedMoE)]

    def hook(mod, args):
        seen.setdefault(id(mod), []).append(args[1].topk_ids_TK.reshape(-1).clone())
    handles = [m.register_forward_pre_hook(hook) for m in mods]
    return mods, seen, handles


def test_counts_equal_the_routers_choices(llm):
    llm.reset_expert_load()
    mods, seen, handles = _hooked_counts(llm)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    load = llm.get_expert_load()
    E, K = load.counts.shape[1], llm.llm_engine.info.model_config.num_experts_per_tok
    assert load.counts.dtype == np.int64 and load.counts.shape == (len(mods), E)
    for row, m in enumerate(mods):
        want = np.bincount(torch.cat(seen[id(m)]).cpu().numpy(), minlength=E)
        assert load.counts[row].tolist() == want.tolist()
    # every token that went through the model counts K times per layer
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    assert load.counts.sum(axis=1).tolist() == [K * tokens] * len(mods)
    assert load.layers == sorted(load.layers) and len(load.layers) == len(mods)
    assert load.per_rank.shape == (len(mods), 1) and (load.per_rank[:, 0] == load.counts.sum(1)).all()
    assert np.allclose(load.balancedness, 1.0)
    llm.reset_expert_load()
    assert llm.get_expert_load().counts.sum() == 0


def test_recording_file_round_trips(llm, tmp_path):
    llm.reset_expert_load()
    path = str(tmp_path / "load.jsonl")
    llm.start_expert_load_recording(path)
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    llm.stop_expert_load_recording()
    load = llm.get_expert_load()
    rec = read_recording(path)
    assert rec.meta.layers == load.layers and rec.meta.num_experts == load.counts.shape[1]
    assert rec.meta.window_steps == 3 and len(rec.windows) >= 3
    first = rec.windows[0].index  # indices count the engine's windows, also those before the file
    assert [w.index for w in rec.windows] == list(range(first, first + len(rec.windows)))
    assert all(w.step_end - w.step_start <= 3 for w in rec.windows)
    assert (sum(w.counts for w in rec.windows) == load.counts).all()
    # nothing more is written after stop
    size = len(open(path).read())
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(open(path).read()) == size


def test_counts_through_the_step_buffers(monkeypatch):
    """On the GPU's input path the count of real rows goes up with the step's inputs (no fill launch):
    the counts still equal K per token and layer, eagerly on the CPU, the dummy start-up forwards not
    counted."""
    from tests.moe.step_buffer_path import force_step_buffers
    force_step_buffers(monkeypatch)
    llm = LLM("tiny-qwen3-moe", enforce_eager=True, max_num_batched_tokens=16, **SMALL_KV)
    runner = llm.llm_engine.executor.runner
    assert runner.buffers is not None and runner.counters.num_valid.data_ptr() == \
        runner.buffers.dev_view("num_valid", 1).data_ptr()
    _assert_every_token_counted(llm, max_tokens=7)
    llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_padding_and_start_up_are_not_counted():
    """Three sequences decode in the graph of size 4: its padding row must not count, nor must
    the profiling forward and the graph warm-ups."""
    llm = LLM("tiny-qwen3-moe", device="cuda", cudagraph_capture_sizes=[4, 8], **SMALL_KV)
    assert llm.get_expert_load().counts.sum() == 0
    _assert_every_token_counted(llm, max_tokens=9)
    llm.shutdown()


def _assert_every_token_counted(llm, max_tokens: int) -> None:
    """Generate PROMPTS greedily: each token that went through the model counts K times a layer."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    load = llm.get_expert_load()
    K = llm.llm_engine.info.model_config.num_experts_per_tok
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    assert load.counts.sum(axis=1).tolist() == [K * tokens] * len(load.layers)


def test_recording_can_be_turned_off():
    llm = LLM("tiny-qwen3-moe", record_expert_load=False, **SMALL_KV)
    assert llm.llm_engine.core.executor.runner.counters is None
    with pytest.raises(RuntimeError, match="record_expert_load=False"):
        llm.get_expert_load()


# ---- EPLB arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize("config,match", [
    ({"window_size": 0}, r"eplb_config\['window_size'\] must be an integer >= 1, got 0"),
    ({"step_interval": "10"}, r"eplb_config\['step_interval'\] must be an integer >= 1"),
    ({"num_redundant_experts": -1}, r"eplb_config\['num_redundant_experts'\] must be an integer >= 0, got -1"),
    ({"log_balancedness": "yes"}, r"eplb_config\['log_balancedness'\] must be true or false"),
    ({"windowsize": 10}, r"unknown key\(s\) \['windowsize'\]"),
    ("{not json", r"eplb_config must be a JSON object"),
    ([1, 2], r"eplb_config must be a dict"),
])
def test_bad_eplb_config(config, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="m", eplb_config=config).validate()


def test_eplb_needs_expert_parallelism():
    with pytest.raises(ValueError, match="enable_eplb needs expert parallelism"):
        EngineArgs(model="m", enable_eplb=True).validate()
    with pytest.raises(ValueError, match="enable_eplb needs expert parallelism"):
        EngineArgs(model="m", enable_eplb=True, enable_expert_parallel=True).validate()
    args = EngineArgs(model="m", enable_eplb=True, enable_expert_parallel=True, data_parallel_size=2,
                      eplb_config='{"num_redundant_experts": 4, "log_balancedness": true}')
    args.validate()
    assert args.eplb == EPLBConfig(num_redundant_experts=4, log_balancedness=True)
    assert EngineArgs(model="m").eplb is None and EPLBConfig.parse(None) == EPLBConfig(1000, 3000, 0, False)


def test_redundant_experts_must_divide_over_the_ranks():
    """Checked before any worker starts, with the model's expert count in the message."""
    with pytest.raises(ValueError, match=r"16 experts \+ eplb_config\['num_redundant_experts'\]=3 physical slots "
                                         r"do not divide over the 2 expert-parallel ranks"):
        LLM("tiny-qwen3-moe", enable_expert_parallel=True, data_parallel_size=2, enable_eplb=True,
            eplb_config={"num_redundant_experts": 3})

