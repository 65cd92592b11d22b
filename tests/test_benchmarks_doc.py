"""BENCHMARKS.md and benchmarks/results/ agree: every raw file the document cites exists, and every
file under benchmarks/results/ is cited (superseded results leave; git history keeps them).

A citation is a backticked path with no spaces, relative to benchmarks/results/, that names a
.json/.log/.txt file or a folder (trailing /); `{a,b}` alternatives and `*` globs expand."""
from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
_RAW = re.compile(r"(\.json|\.log|\.txt|/)$")
_CODE_DIRS = ("benchmarks/", "kernels/", "models/", "moe/", "tests/", "all2all/", "routing/", "scheduler/")


def expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand_braces(path[:m.start()] + alt + path[m.end():])]


def cited_paths(text: str) -> list[str]:
    """The raw-file citations of a document, expanded, relative to benchmarks/results/."""
    out = []
    for span in re.findall(r"`([^`\s]+)`", text):
        for path in expand_braces(span):
            if _RAW.search(path) and not path.startswith(_CODE_DIRS):
                out.append(path)
    return out


def check(text: str, results_dir: str) -> tuple[list[str], list[str]]:
    """(cited paths that match nothing, files under results_dir that no citation covers)."""
    missing, covered = [], set()
    for path in cited_paths(text):
        hits = glob.glob(os.path.join(results_dir, path))
        if not hits:
            missing.append(path)
        for hit in hits:
            if os.path.isdir(hit):
                covered.update(os.path.join(d, f) for d, _, fs in os.walk(hit) for f in fs)
            else:
                covered.add(hit)
    files = {os.path.join(d, f) for d, _, fs in os.walk(results_dir) for f in fs}
    return missing, sorted(os.path.relpath(f, results_dir) for f in files - covered)


def test_every_cited_raw_file_exists_and_every_raw_file_is_cited():
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(cited_paths(text)) > 20  # the parser finds the citations
    missing, uncited = check(text, RESULTS)
    assert missing == [], "BENCHMARKS.md cites raw files that do not exist"
    assert uncited == [], "benchmarks/results/ holds files BENCHMARKS.md does not cite"


def test_the_check_can_fail(tmp_path):
    (tmp_path / "run").mkdir()
    for name in ["a.json", "a.log", "b.json", "run/x.json"]:
        (tmp_path / name).write_text("{}")
    text = "numbers (`a.{json,log}`, `run/`), a command `python3 x.py --out $OUT/a.json` and `gone.json`"
    assert check(text, str(tmp_path)) == (["gone.json"], ["b.json"])
