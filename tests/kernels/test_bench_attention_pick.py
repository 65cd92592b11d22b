"""benchmarks/bench_attention.py's pick_unified_tile (the `unified-tiles` GPU stage's choice): the fastest
swept tile on the chunk-alone rows, only when it beats the shipped one by the margin on every row."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_attention import pick_unified_tile  # noqa: E402


def rows(times: dict) -> list[dict]:
    """times: {(N, W, S) or None: {chunk: us}} -> sweep rows (64-row tiles), with a mixed step that is no chunk row."""
    out = [{"kind": "mixed", "decodes": 256, "chunk": 512, "config": None, "block_q": None, "unified_us": 1.0}]
    for tile, by_chunk in times.items():
        cfg = None if tile is None else dict(zip(("BLOCK_N", "num_warps", "num_stages"), tile))
        for chunk, us in by_chunk.items():
            out.append({"kind": "mixed", "decodes": 0, "chunk": chunk, "config": cfg, "block_q": None if tile is None
                        else 8, "unified_us": us})
    out.append({"kind": "mixed", "decodes": 0, "chunk": 512, "config": {"BLOCK_N": 16, "num_warps": 4,
                "num_stages": 2}, "block_q": 2, "unified_us": 1.0})  # 16-row tiles: not a candidate
    return out


def test_picks_the_fastest_tile_that_wins_on_every_chunk_row():
    shipped = {512: 100.0, 2048: 300.0}
    assert pick_unified_tile(rows({None: shipped, (32, 4, 3): {512: 90.0, 2048: 280.0},
                                   (16, 4, 3): {512: 80.0, 2048: 285.0}, (64, 4, 2): {512: 99.0, 2048: 299.0}})) \
        == "16,4,3"
    # one row not 4% faster: no winner
    assert pick_unified_tile(rows({None: shipped, (32, 4, 3): {512: 90.0, 2048: 295.0}})) is None
    assert pick_unified_tile(rows({(32, 4, 3): {512: 90.0}})) is None  # no shipped row to compare with


def test_the_stage_reads_a_sweep_file(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"results": rows({None: {512: 100.0, 2048: 300.0},
                                                 (32, 4, 3): {512: 90.0, 2048: 280.0}})}))
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); from bench_attention import pick_unified_tile\n"
            "print(pick_unified_tile(json.load(open(sys.argv[1]))['results']) or '')")
    with open(os.path.join(ROOT, "benchmarks", "gpu_run.sh")) as f:
        assert code in f.read()  # the same line as the stage's
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "32,4,3"
