"""The CPU path's malloc settings (moe/worker/cpu_memory.py)."""
from __future__ import annotations

import ctypes
import sys

import pytest

from moe.worker import cpu_memory


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(cpu_memory, "_applied", None)


class FakeLibc:
    def __init__(self, result=1):
        self.calls, self.result = [], result

        def mallopt(param, value):
            self.calls.append((param, value))
            return self.result
        self.mallopt = mallopt


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_settings_applied_once(fresh, monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda *a, **k: libc)
    assert cpu_memory.keep_freed_memory() is True
    assert dict(libc.calls) == {cpu_memory.M_MMAP_THRESHOLD: 32 * 2 ** 20,
                                cpu_memory.M_TRIM_THRESHOLD: 2 ** 30, cpu_memory.M_TOP_PAD: 64 * 2 ** 20}
    assert cpu_memory.keep_freed_memory() is True and len(libc.calls) == 3, "applied once per process"


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_refusal_and_missing_mallopt_report_false(fresh, monkeypatch):
    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda *a, **k: FakeLibc(result=0))
    assert cpu_memory.keep_freed_memory() is False
    monkeypatch.setattr(cpu_memory, "_applied", None)
    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda *a, **k: object())  # a libc without mallopt
    assert cpu_memory.keep_freed_memory() is False


def test_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("MOE_CPU_KEEP_FREED_MEMORY", "0")
    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda *a, **k: pytest.fail("libc touched"))
    assert cpu_memory.keep_freed_memory() is False


@pytest.mark.skipif(sys.platform != "linux" or not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"),
                    reason="glibc only")
def test_real_glibc_accepts_the_settings(fresh):
    assert cpu_memory.keep_freed_memory() is True


def test_cpu_worker_applies_it(monkeypatch):
    """Building a CPU engine calls it (the built-in tiny model)."""
    seen = []
    monkeypatch.setattr("moe.worker.worker.keep_freed_memory", lambda: seen.append(1) or True)
    from moe import LLM
    LLM("tiny-qwen3-moe", device="cpu", max_model_len=64, max_num_seqs=2)
    assert seen == [1]
