"""Helpers for the server tests: a chat-capable copy of the built-in tiny model, and a `moe serve`
subprocess on loopback with a free port and a bounded start-up wait."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "test-key"
MODEL_NAME = "tiny-chat"
# Small KV cache and context: the tiny model in two processes stays light on a 2-core machine.
ENGINE_ARGS = {"device": "cpu", "max_model_len": 256, "kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 32}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_chat_model(folder: str) -> str:
    """The built-in tiny model plus a tokenizer_config.json with a chat template."""
    from models.tiny import ensure_tiny_model

    src = ensure_tiny_model("tiny-qwen3-moe")
    shutil.copytree(src, folder, dirs_exist_ok=True)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_engine_args() -> list[str]:
    out = []
    for k, v in ENGINE_ARGS.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


class ServerProcess:
    """`moe serve` on loopback, returned once /health answers. api_key=None leaves --api-key off (the key,
    if any, then comes from `env`); `env` is merged over os.environ; `launcher` replaces
    `python -m moe.entrypoints.cli` (e.g. a wrapper script); start_new_session puts the server in a
    process group of its own, so that a test can signal all of it."""

    log_tail = 4000  # characters of the log that read_log returns

    def __init__(self, model: str, log_path: str, extra: list[str] = (), startup_s: float = 120.0, *,
                 api_key: str | None = API_KEY, env: dict | None = None, launcher: list[str] | None = None,
                 start_new_session: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        key_flag = ["--api-key", api_key] if api_key is not None else []
        self.proc = subprocess.Popen(
            [*(launcher or [sys.executable, "-m", "moe.entrypoints.cli"]), "serve", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--served-model-name", MODEL_NAME, *key_flag,
             "--uvicorn-log-level", "warning", *cli_engine_args(), *extra],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=start_new_session,
            env={**os.environ, **(env or {})})
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moe serve exited with {self.proc.returncode}: {self.read_log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"moe serve did not become healthy within {startup_s} s: {self.read_log()}")

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-self.log_tail:]

    def core_pid(self) -> int:
        """The engine core: the child process of the server running moe.engine.core_process."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if ppid == self.proc.pid and b"moe.engine.core_process" in cmdline:
                return int(pid)
        raise RuntimeError("no engine core process found")

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def process_tree(root: int) -> list[int]:
    """root and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def headers() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def scrape_metrics(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client's text parser (no _bucket samples): sample name -> value
    summed over its label sets, and, for a sample with labels besides model_name, also
    'name{label="value",...}' (those labels, sorted) -> value, e.g.
    'moe:request_success_total{finished_reason="length"}'."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers(), timeout=5.0).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
            labels = sorted((k, v) for k, v in s.labels.items() if k != "model_name")
            if labels:
                key = s.name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def expert_tokens_total(url: str) -> float:
    """moe:expert_load_tokens summed over its (layer, ep_rank) series."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers(), timeout=5.0).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "moe:expert_load_tokens_total")


def wait_until_idle(url: str, timeout_s: float, poll_s: float = 0.1) -> dict[str, float]:
    """Metrics once no request runs and the KV cache is empty again, or when timeout_s has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(url)
        if m["moe:kv_cache_usage_perc"] == 0 and m["moe:num_requests_running"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(poll_s)

