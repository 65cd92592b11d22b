"""vLLM's command-line habits: `moe --version`, `--help=all`, a help text on every flag, and the
model given positionally or as --model."""
from __future__ import annotations

import argparse
import importlib.metadata
import json

import pytest

import moe
from moe.entrypoints.cli import _model_flag_first, build_parser, main
from tests.test_cli import run_moe


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_version_prints_the_package_version():
    r = run_moe("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == moe.__version__ == importlib.metadata.version("moe-runtime")


def test_help_all_prints_every_command_and_one_command_alone():
    r = run_moe("--help=all")
    assert r.returncode == 0, r.stderr
    for usage in ("usage: moe ", "usage: moe generate", "usage: moe serve", "usage: moe bench throughput",
                  "usage: moe bench serve", "usage: moe dashboard"):
        assert usage in r.stdout
    r = run_moe("serve", "--help=all")
    assert r.returncode == 0 and "usage: moe serve" in r.stdout and "usage: moe generate" not in r.stdout
    assert "--api-server-count" in r.stdout and "--max-model-len" in r.stdout
    r = run_moe("bench", "serve", "--help=all")
    assert r.returncode == 0 and "usage: moe bench serve" in r.stdout and "--api-key" in r.stdout


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """The parsers of the commands with flags: generate, serve, dashboard and the benchmarks that run on the CPU."""
    from moe.bench import engine_cpu, latency, serve, throughput

    parsers = {name: p for name, p in _commands().items() if name in ("generate", "serve", "dashboard")}
    for name, module in {"serve": serve, "throughput": throughput, "latency": latency,
                         "engine-cpu": engine_cpu}.items():
        parsers[f"bench {name}"] = module.build_parser()
    return parsers


def test_every_flag_has_a_help_text():
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in _parsers().items() for a in p._actions
               if not (a.help or "").strip()]
    assert missing == []


@pytest.mark.parametrize("command", ["generate", "serve", "bench throughput", "bench latency"])
def test_every_engine_flag_shows_its_help_and_default(command):
    """Each engine argument's flag: its own text from moe/config.py and its default, whatever the formatter
    of the command's parser (generate and serve append defaults, the benchmarks' parsers do not)."""
    import dataclasses

    from moe.config import ENGINE_ARG_HELP, EngineArgs

    parser = _parsers()[command]
    formatter = parser._get_formatter()
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(ENGINE_ARG_HELP) == fields
    actions = {a.dest: a for a in parser._actions if a.dest in fields}
    assert set(actions) == fields
    for dest, action in actions.items():
        text = formatter._expand_help(action)  # what --help prints
        if dest == "model":  # the benchmarks give it a default and words of their own
            continue
        if dest != "seed":  # ditto
            assert text.startswith(ENGINE_ARG_HELP[dest].split(" (default: ")[0]), dest
        assert text.count("(default: ") == 1 and f"(default: {action.default}" in text, (dest, text)


@pytest.mark.parametrize("argv, message", [
    (["generate"], "give the model: moe generate MODEL PROMPT... (or --model MODEL)"),
    (["serve"], "give the model: moe serve MODEL"),
    (["serve", "a", "--model", "b"], "two models given: 'a' and --model 'b'"),
])
def test_a_missing_or_doubled_model_is_a_clear_error(argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_takes_the_model_positionally_or_as_a_flag(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    for argv in (["generate", missing, "Hello"], ["generate", "--model", missing, "Hello"]):
        assert main(argv) == 1
        assert f"{missing}" in capsys.readouterr().err  # the folder was taken as the model, not as a prompt
    r = run_moe("generate", "tiny-qwen3-moe", "Hello", "--max-tokens", "2", "--json",
                env={"MOE_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["prompt"] for o in out] == ["Hello"]  # the model name is no prompt


def test_bench_takes_the_model_positionally_too():
    assert _model_flag_first("throughput", ["M", "--num-prompts", "2"]) == ["--model", "M", "--num-prompts", "2"]
    assert _model_flag_first("latency", ["M", "--model", "M"])[:2] == ["--model", "M"]
    assert _model_flag_first("scheduler", ["--steps", "3"]) == ["--steps", "3"]  # no model there
    with pytest.raises(ValueError, match="two models given: 'M' and --model 'N'"):
        _model_flag_first("serve", ["M", "--model=N"])
