"""Run by tests/parallel/test_torchrun.py under `torchrun --nproc-per-node 2 -m ...`: every rank
builds the same LLM (the executor reads RANK / WORLD_SIZE / LOCAL_RANK), generates the same
prompts, and writes what it got to <out_dir>/rank<RANK>.json."""
from __future__ import annotations

import json
import os
import sys

from moe import LLM
from tests.parallel.conftest import prompts, sampling_params, summarize


def main() -> None:
    ckpt, out_dir, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(ckpt, dtype="float32", device="cpu", **kwargs)
    got = summarize(llm.generate(prompts(), sampling_params(), use_tqdm=False))
    llm.llm_engine.shutdown()
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    main()
