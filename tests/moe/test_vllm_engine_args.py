"""vLLM's engine arguments: tokenizer_mode, revision, kv_cache_dtype, and the arguments accepted
with a warning because they change nothing here (swap_space, cpu_offload_gb, ...)."""
from __future__ import annotations

import argparse
import logging

import pytest
import torch

from moe import LLM, SamplingParams
from moe.config import EngineArgs


def _validate(**kwargs) -> EngineArgs:
    args = EngineArgs(model=kwargs.pop("model", "tiny-qwen3-moe"), **kwargs)
    args.validate()
    return args


@pytest.mark.parametrize("mode", ["auto", "hf"])
def test_tokenizer_modes_the_loader_honours(mode):
    _validate(tokenizer_mode=mode)


@pytest.mark.parametrize("mode", ["slow", "mistral", "custom", "AUTO"])
def test_other_tokenizer_modes_are_refused(mode):
    with pytest.raises(ValueError, match=rf"tokenizer_mode must be one of .*got '{mode}'.*fast"):
        _validate(tokenizer_mode=mode)


@pytest.mark.parametrize("dtype,expect", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                          ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_kv_cache_dtypes(dtype, expect):
    args = _validate(kv_cache_dtype=dtype)
    for model_dtype in (torch.float32, torch.bfloat16, torch.float16):  # any model dtype: the cache is FP8
        assert args.resolve_kv_cache_dtype(model_dtype) == expect
    assert EngineArgs("m", dtype="bfloat16", kv_cache_dtype=dtype).resolve_dtype(None) == torch.bfloat16


@pytest.mark.parametrize("dtype", ["fp8_inc", "fp8_ds_mla"])
def test_other_fp8_formats_are_refused(dtype):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='{dtype}' is not supported; use 'auto'.*'fp8_e5m2'"):
        _validate(kv_cache_dtype=dtype)


def test_kv_cache_dtype_is_the_model_dtype():
    assert EngineArgs("m", dtype="bfloat16", kv_cache_dtype="bfloat16").resolve_dtype(None) == torch.bfloat16
    assert EngineArgs("m", kv_cache_dtype="auto").resolve_dtype("float16") == torch.float16
    assert EngineArgs("m", kv_cache_dtype="half").resolve_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype='float16' differs from the model dtype bfloat16"):
        EngineArgs("m", kv_cache_dtype="float16").resolve_dtype("bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        _validate(kv_cache_dtype="int8")


def test_revision():
    _validate(revision="main")
    _validate(revision="v1.0")  # a local model: nothing to download
    _validate(model="some-org/some-model", revision="main")
    _validate(model="some-org/some-model", revision="v1.0")  # applied by the hub download (test below)
    with pytest.raises(ValueError, match="revision must be a branch, tag or commit"):
        _validate(revision="")


def test_arguments_without_effect_warn_once(caplog):
    with caplog.at_level(logging.WARNING, logger="moe.config"):
        _validate()
        _validate(swap_space=None, cpu_offload_gb=0, disable_custom_all_reduce=False)
        assert not caplog.records
        _validate(swap_space=4, cpu_offload_gb=2.5, disable_custom_all_reduce=True)
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "without effect" in msg and all(n in msg for n in ("swap_space=4", "cpu_offload_gb=2.5",
                                                              "disable_custom_all_reduce=True"))
    for name in ("swap_space", "cpu_offload_gb"):
        with pytest.raises(ValueError, match=rf"{name} must be a number >= 0"):
            _validate(**{name: -1})


def test_cli_flags():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model", "m", "--tokenizer-mode", "hf", "--revision", "main", "--kv-cache-dtype",
                            "bfloat16", "--swap-space", "4", "--cpu-offload-gb", "0", "--disable-custom-all-reduce"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.tokenizer_mode, args.revision, args.kv_cache_dtype, args.swap_space, args.cpu_offload_gb,
            args.disable_custom_all_reduce) == ("hf", "main", "bfloat16", 4.0, 0.0, True)


def test_llm_takes_them(caplog):
    with caplog.at_level(logging.WARNING, logger="moe.config"):
        llm = LLM("tiny-qwen3-moe", device="cpu", max_model_len=64, kv_cache_memory_bytes=8 << 20,
                  tokenizer_mode="auto", revision="main", kv_cache_dtype="float32", swap_space=4)
    with llm:
        assert llm.llm_engine.dtype == torch.float32
        assert llm.llm_engine.executor.runner.kv_dtype == torch.float32
        out = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    assert any("swap_space=4" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' differs from the model dtype float32"):
        LLM("tiny-qwen3-moe", device="cpu", kv_cache_dtype="bfloat16")


def test_revision_reaches_the_hub_download(monkeypatch, tmp_path):
    import huggingface_hub

    from moe.engine.model_info import resolve_model_path
    calls = []

    def fake_download(repo_id, revision=None, local_files_only=False, **kwargs):
        calls.append((repo_id, revision, local_files_only))
        return str(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model_path("some-org/some-model", "v1.0") == str(tmp_path)
    assert calls == [("some-org/some-model", "v1.0", True)]  # the cache first, at that revision
