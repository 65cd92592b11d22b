"""CUDA-graph decode: the capture sizes and the padding rule (on any machine), the engine
arguments that steer them, and on a GPU the same greedy tokens with graphs as without."""
import pytest
import torch

from moe.config import EngineArgs
from moe.worker.cuda_graphs import DecodeGraphs, default_capture_sizes


def test_default_capture_sizes():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and all(s % 8 == 0 for s in sizes[3:])


def test_padded_size_is_the_smallest_captured_size_that_fits():
    graphs = DecodeGraphs([8, 1, 4, 2, 4])
    assert graphs.sizes == [1, 2, 4, 8]
    assert graphs.padded_size(3) is None  # nothing captured yet: run eagerly
    graphs.graphs = {s: object() for s in graphs.sizes}
    assert [graphs.padded_size(b) for b in (1, 3, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]


@pytest.mark.parametrize("sizes", [[], [0, 4], [-1]])
def test_bad_capture_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        EngineArgs(model="m", cudagraph_capture_sizes=sizes).validate()


def test_capture_sizes_flag():
    import argparse
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--cudagraph-capture-sizes", "1", "2", "4",
                                                       "--enforce-eager"]))
    assert args.cudagraph_capture_sizes == [1, 2, 4] and args.enforce_eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_give_the_eager_tokens():
    import random

    from moe import LLM, SamplingParams
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(n)]} for n in (1, 9, 33, 70, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        with LLM("tiny-qwen3-moe", device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=4,
                 gpu_memory_utilization=0.2) as llm:
            graphs = llm.llm_engine.executor.runner.graphs
            assert (graphs is None) == eager and (eager or sorted(graphs.graphs) == [1, 2, 4])
            outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(outs[False]) == len(prompts) and outs[False] == outs[True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_async_scheduling_gives_the_synchronous_tokens_with_graphs():
    """On the GPU the next step's pending inputs are filled on the device before a graph replay."""
    import random

    from moe import LLM, SamplingParams
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(n)]} for n in (1, 9, 33, 70, 5, 17)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=10 + i, logprobs=1)
              for i in range(len(prompts))]
    outs = {}
    for requested in (False, None):  # None, the default, is async on CUDA
        with LLM("tiny-qwen3-moe", device="cuda", dtype="float32", max_num_seqs=4, gpu_memory_utilization=0.2,
                 async_scheduling=requested) as llm:
            assert llm.llm_engine.core.async_scheduling is (requested is None)
            outs[requested] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                               for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[None] == outs[False]
