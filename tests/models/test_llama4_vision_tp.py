"""The Llama-4 vision tower at tensor_parallel_size 2 (gloo, spawned CPU ranks) in both
`mm_encoder_tp_mode`s gives the single process's features (fp32), for an odd number of tiles (data
mode pads), one tile, and the tiles of several images; the checkpoint is loaded from two shard files.

Checkpoints (tests/factories_llama4_mm.py, random): "split" = the tiny tower (2 heads, every linear
divisible by 2), "odd_adapter" = the adapter width 45 (adapter replicated, projector still split in
"weights" mode), "one_head" = 1 head (mode "weights" cannot split it: a clear error; "data" works).
All ranks' jobs run in one spawn (the spawn dominates the time).
"""
from __future__ import annotations

import pytest
import torch

from models.llama4_vision import Llama4VisionConfig, Llama4VisionEncoder
from tests.all2all.a2a_harness import run_ranks

TP = 2
TILE_BATCHES = {"odd_5": [5], "one_tile": [1], "images_2_1_4": [2, 1, 4], "even_4": [4]}  # tiles per image
CKPT_VISION = {
    "split": {},
    "odd_adapter": dict(projector_input_dim=45, projector_output_dim=45, vision_output_dim=45),
    "one_head": dict(num_attention_heads=1),
}
JOBS = [("split", "weights"), ("split", "data"), ("odd_adapter", "weights"), ("one_head", "weights"),
        ("one_head", "data")]


def _pixels(tiles_per_image: list[int], seed: int) -> torch.Tensor:
    """The tiles of the images, concatenated image after image (as the processor gives them)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(n, 3, 56, 56, generator=gen) for n in tiles_per_image])


def _encoder(ckpt: str, mode: str) -> Llama4VisionEncoder:
    """The standalone encoder of `ckpt` with the given mode, loaded under the current parallel state."""
    import json
    import os

    from models.loader import load_weights

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = Llama4VisionConfig.from_hf(json.load(f))
    cfg.mm_encoder_tp_mode = mode
    encoder = Llama4VisionEncoder(cfg).float().eval()
    load_weights(encoder, ckpt, progress=False)
    return encoder


@torch.no_grad()
def _run(encoder: Llama4VisionEncoder) -> dict:
    """Features of every tile batch, and how many tiles the first encoder layer saw per batch."""
    seen = []
    hook = encoder.vision_model.model.layers[0].register_forward_hook(
        lambda mod, args, out: seen.append(args[0].shape[0]))
    try:
        features = {name: encoder(_pixels(tiles, seed=i)) for i, (name, tiles) in enumerate(TILE_BATCHES.items())}
    finally:
        hook.remove()
    return dict(features=features, tiles_seen=seen,
                shapes={n: tuple(p.shape) for n, p in encoder.named_parameters()})


def _tp_worker(rank: int, world_size: int, ckpts: dict, jobs: list) -> list:
    from models.parallel.state import ParallelLayout, init_parallel_state, reset_parallel_state

    init_parallel_state(ParallelLayout(tp=world_size), rank)
    results = []
    try:
        for name, mode in jobs:
            try:
                encoder = _encoder(ckpts[name], mode)
            except ValueError as e:  # every rank fails the same way, before any collective
                results.append(dict(error=str(e)))
                continue
            results.append(_run(encoder))
    finally:
        reset_parallel_state()
    return results


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict:
    from tests.factories_llama4_mm import make_llama4_mm_model, save_llama4_mm_checkpoint

    return {name: save_llama4_mm_checkpoint(make_llama4_mm_model(seed=3, vision_overrides=over),
                                            str(tmp_path_factory.mktemp(name)), shards=2)
            for name, over in CKPT_VISION.items()}


@pytest.fixture(scope="module")
def single_process(ckpts) -> dict:
    """Per checkpoint: the one-process run (TP 1; the mode does not matter there)."""
    return {name: _run(_encoder(path, "weights")) for name, path in ckpts.items()}


@pytest.fixture(scope="module")
def tp_runs(ckpts) -> dict:
    per_rank = run_ranks(_tp_worker, TP, args=(ckpts, JOBS), timeout_s=90.0, collective_timeout_s=30.0)
    return {job: [per_rank[r][i] for r in range(TP)] for i, job in enumerate(JOBS)}


def _assert_same_features(ranks: list[dict], reference: dict) -> None:
    for batch, tiles in TILE_BATCHES.items():
        want = reference["features"][batch]
        assert want.shape == (sum(tiles) * 4, 64) and want.abs().mean() > 0.1  # O(1) features
        for rank, got in enumerate(ranks):
            assert got["features"][batch].shape == want.shape, (rank, batch)
            torch.testing.assert_close(got["features"][batch], want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank}, tiles {tiles}: {m}")


@pytest.mark.parametrize("name,mode", [j for j in JOBS if j != ("one_head", "weights")])
def test_tp2_features_equal_single_process(tp_runs, single_process, name, mode):
    _assert_same_features(tp_runs[name, mode], single_process[name])


def test_weights_mode_splits_the_linears(tp_runs, single_process):
    D, inter, A, E = 32, 128, 48, 64
    full = single_process["split"]["shapes"]
    layer = "vision_model.model.layers.1."
    split_shapes = {
        layer + "self_attn.q_proj.weight": (D // TP, D), layer + "self_attn.v_proj.bias": (D // TP,),
        layer + "self_attn.o_proj.weight": (D, D // TP), layer + "self_attn.o_proj.bias": (D,),
        layer + "mlp.fc1.weight": (inter // TP, D), layer + "mlp.fc2.weight": (D, inter // TP),
        "vision_model.vision_adapter.mlp.fc1.weight": (A // TP, inter),
        "vision_model.vision_adapter.mlp.fc2.weight": (A, A // TP),
        "multi_modal_projector.linear_1.weight": (E // TP, A),
    }
    replicated = ["vision_model.patch_embedding.linear.weight", "vision_model.class_embedding",
                  "vision_model.positional_embedding_vlm", "vision_model.layernorm_pre.weight",
                  layer + "input_layernorm.bias"]
    for rank in tp_runs["split", "weights"]:
        assert set(rank["shapes"]) == set(full)
        for n, shape in split_shapes.items():
            assert rank["shapes"][n] == shape, n
        for n in replicated:
            assert rank["shapes"][n] == full[n], n
        assert rank["tiles_seen"] == [sum(t) for t in TILE_BATCHES.values()]  # every rank: all tiles
    for rank in tp_runs["split", "data"]:
        assert rank["shapes"] == full  # data mode: everything replicated


def test_weights_mode_replicates_an_adapter_that_does_not_divide(tp_runs, single_process):
    full = single_process["odd_adapter"]["shapes"]
    for rank in tp_runs["odd_adapter", "weights"]:
        for n in ("vision_model.vision_adapter.mlp.fc1.weight", "vision_model.vision_adapter.mlp.fc2.weight"):
            assert rank["shapes"][n] == full[n] == ((45, 128) if "fc1" in n else (45, 45)), n
        assert rank["shapes"]["multi_modal_projector.linear_1.weight"] == (64 // TP, 45)
        assert rank["shapes"]["vision_model.model.layers.0.mlp.fc1.weight"] == (128 // TP, 32)


def test_data_mode_ranks_run_only_their_share(tp_runs):
    """Each rank's encoder layers see ceil(N / TP) tiles (padded), not all N: no silent replication."""
    want = [-(-sum(t) // TP) for t in TILE_BATCHES.values()]
    assert want == [3, 1, 4, 2]
    for name in ("split", "one_head"):
        for rank in tp_runs[name, "data"]:
            assert rank["tiles_seen"] == want


def test_weights_mode_needs_heads_divisible_by_tp(tp_runs):
    for rank in tp_runs["one_head", "weights"]:
        assert "num_attention_heads=1 is not divisible by tensor_parallel_size=2" in rank["error"]
        assert "mm_encoder_tp_mode='data'" in rank["error"]


def test_invalid_mode_is_an_error():
    with pytest.raises(ValueError, match=r"mm_encoder_tp_mode='tensor' is not supported: use 'weights'"):
        Llama4VisionConfig(mm_encoder_tp_mode="tensor")
    cfg = Llama4VisionConfig(hidden_size=32, intermediate_size=128, num_attention_heads=2, image_size=56,
                             vision_output_dim=48, projector_input_dim=48, projector_output_dim=48)
    assert cfg.mm_encoder_tp_mode == "weights"
    cfg.mm_encoder_tp_mode = "Data"  # set after construction (as the engine does): caught by check()
    with pytest.raises(ValueError, match="mm_encoder_tp_mode='Data' is not supported"):
        Llama4VisionEncoder(cfg)


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_tp1_is_the_replicated_path(ckpts, single_process, mode):
    """At TP 1 both modes build replicated linears and give the same features bit for bit."""
    from models.layers.linear import ReplicatedLinear

    encoder = _encoder(ckpts["split"], mode)
    assert not encoder.split_weights and not encoder.split_tiles
    assert isinstance(encoder.vision_model.model.layers[0].self_attn.q_proj, ReplicatedLinear)
    assert isinstance(encoder.multi_modal_projector.linear_1, ReplicatedLinear)
    got = _run(encoder)
    for batch in TILE_BATCHES:
        assert torch.equal(got["features"][batch], single_process["split"]["features"][batch])


# ---- benchmarks/vision_encoder_gpu_bench.py kept runnable (its --device cpu --tiny smoke mode) ------

def _bench_report(path) -> dict:
    import json

    with open(path) as f:
        report = json.load(f)
    assert report["tiny"] and report["tiles_per_image"] == 5 and report["tokens_per_tile"] == 4
    for mode in ("weights", "data"):
        rows = report["results"][mode]["rows"]
        assert [(r["images"], r["tiles"]) for r in rows] == [(1, 5), (3, 15)]
        assert all(r["median_ms"] > 0 and r["tiles_per_s"] == pytest.approx(5 * r["images_per_s"], rel=1e-2)
                   for r in rows)
    assert report["check"]["feature_abs_mean"] > 0.05
    return report


def test_bench_scout_shape_is_valid():
    from benchmarks.vision_encoder_gpu_bench import SCOUT_VISION

    cfg = Llama4VisionConfig(**SCOUT_VISION)
    cfg.check()
    assert (cfg.tokens_per_tile, cfg.head_dim, cfg.num_attention_heads % 8) == (144, 88, 0)


def test_bench_script_one_process(tmp_path):
    from benchmarks.vision_encoder_gpu_bench import main

    out = tmp_path / "tp1.json"
    assert main(["--device", "cpu", "--tiny", "--output-json", str(out)]) == 0
    report = _bench_report(out)
    assert report["tp_size"] == 1 and report["dtype"] == "bf16"
    assert report["check"]["max_abs_diff"] == 0.0 and report["check"]["ok"]  # TP 1: the same code
    # A failed check fails the run (after writing the JSON).
    assert main(["--device", "cpu", "--tiny", "--check-tol", "-1", "--output-json", str(out)]) == 1
    assert not _bench_report(out)["check"]["ok"]


def test_bench_script_torchrun_two_ranks(tmp_path):
    import os
    import subprocess
    import sys

    from tests.all2all.a2a_harness import free_port

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "tp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(root, "benchmarks", "vision_encoder_gpu_bench.py"), "--device", "cpu", "--tiny",
           "--dtype", "fp32", "--output-json", str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _bench_report(out)
    assert report["tp_size"] == 2 and report["dtype"] == "fp32"
    assert report["check"]["ok"] and report["check"]["rel_diff"] < 1e-5  # weights mode == data mode
