"""Several nodes' launch path, on localhost: `torchrun --nproc-per-node 2` starts two CPU ranks
that each run the whole engine; both return the single process's outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.all2all.a2a_harness import free_port
from tests.parallel.conftest import assert_same_as_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=2, enable_expert_parallel=True)])
def test_torchrun_two_ranks(parallel_ckpt, reference, tmp_path, kwargs):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "tests.parallel.torchrun_generate", parallel_ckpt, str(tmp_path), json.dumps(kwargs)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            got = [(tokens, lps) for tokens, lps in json.load(f)]
        assert_same_as_reference(got, reference)
