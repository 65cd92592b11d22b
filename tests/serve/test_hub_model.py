"""A model given as a Hugging Face hub id is read from the local hub cache; one that is neither a
folder nor cached fails with a clear error when the hub cannot be reached."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.serve.helpers import ROOT

_PROBE = """
import sys
from moe.engine.model_info import resolve_model_path
for model in sys.argv[1:]:
    try:
        print("PATH", resolve_model_path(model))
    except OSError as e:
        print("ERROR", e)
"""


def test_hub_id_from_the_local_cache_and_a_clear_error_offline(tmp_path, model_dir):
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-moe" / "snapshots" / "0123abcd"
    shutil.copytree(model_dir, snapshot)
    (cache / "models--acme--tiny-moe" / "refs").mkdir()
    (cache / "models--acme--tiny-moe" / "refs" / "main").write_text("0123abcd")
    # A fresh interpreter: huggingface_hub reads its cache folder and offline switch at import.
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _PROBE, "acme/tiny-moe", "acme/not-there"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    found, missing = out.stdout.strip().splitlines()[-2:]
    assert found == f"PATH {snapshot}"
    assert missing.startswith("ERROR") and "acme/not-there" in missing and "Hugging Face cache" in missing
