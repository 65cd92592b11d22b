"""`moe serve` through its life: a /dev/shm that fills up after start (images go inline, no SIGBUS),
an API process killed under --api-server-count 2 (restarted, the other serves on), SIGTERM with a
short --shutdown-timeout (in-flight requests finish or end with an error, new ones get 503, prompt
exit), and what a server leaves in /tmp and /dev/shm (nothing after a clean exit; after SIGKILL of
its process group, the next start removes it, sparing a live owner's).

Two servers, each in a process group of its own (killed whole at teardown, whatever happened). The
tests run in file order and share them: the first (multimodal, one API process) goes through the
full /dev/shm; the reclaim test kills its group and starts the second (two API processes), which
must remove what that left; the restart test kills one of its API processes; the drain test stops it."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from tests.factories_llama4_mm import data_url, make_llama4_mm_model, picture, save_llama4_mm_checkpoint
from tests.serve.helpers import API_KEY, MODEL_NAME, ROOT, ServerProcess, headers, process_tree

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")

SHM_FLAGS = ["--mm-processor-cache-type", "shm", "--mm-processor-cache-gb", "0.001"]
FULL_FLAG_ENV = "MOE_TEST_SHM_FULL_FLAG"

# Runs `moe serve` with os.posix_fallocate failing (ENOSPC) while the file named by $MOE_TEST_SHM_FULL_FLAG
# exists: what a full /dev/shm answers to a reservation. The API processes (multiprocessing's spawn
# children) import this file again as their main module, so they get the patch too.
FULL_SHM_WRAPPER = f'''
import errno, os, sys

_flag, _real = os.environ["{FULL_FLAG_ENV}"], os.posix_fallocate


def _fallocate(fd, offset, length):
    if os.path.exists(_flag):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _real(fd, offset, length)


os.posix_fallocate = _fallocate

if __name__ == "__main__":
    from moe.entrypoints.cli import main

    sys.exit(main(sys.argv[1:]))
'''


class Server(ServerProcess):
    """`moe serve` in a process group of its own (so that a test can SIGKILL all of it), with moe
    importable for a launcher script outside ROOT (PYTHONPATH), and more of the log kept: tests look for
    lines in it."""

    log_tail = 6000

    def __init__(self, model: str, log_path: str, extra: list[str] = (), launcher: list[str] | None = None,
                 env: dict | None = None) -> None:
        super().__init__(model, log_path, extra, launcher=launcher, env={"PYTHONPATH": ROOT, **(env or {})},
                         start_new_session=True)

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid) if self.proc.poll() is None else []

    def api_pids(self) -> list[int]:
        """The API processes a launcher spawned (multiprocessing's spawn children, not its resource tracker)."""
        return [p for p in self.pids() if p != self.proc.pid and _parent(p) == self.proc.pid
                and b"spawn_main" in _cmdline(p)]

    def kill(self) -> None:
        """SIGKILL to the whole process group, then reap: nothing of it keeps running."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.log.close()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Teardown (and a failed start): a polite SIGTERM first, then the whole group killed all the same."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def _stat_field(pid: int, i: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[i]


def _parent(pid: int) -> int | None:
    try:
        return int(_stat_field(pid, 1))
    except OSError:
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    try:
        return _stat_field(pid, 0) != "Z"
    except OSError:
        return False


def leftovers(pids) -> list[str]:
    """What processes `pids` own in /tmp (moe-core-<pid>-*, moe-prometheus-<pid>-*) and /dev/shm (moe_mm_<pid>_*)."""
    tmp = tempfile.gettempdir()
    out = []
    for pid in pids:
        out += [os.path.join(tmp, n) for n in os.listdir(tmp)
                if n.startswith((f"moe-core-{pid}-", f"moe-prometheus-{pid}-"))]
        out += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(f"moe_mm_{pid}_")]
    return out


def wait_for(predicate, timeout_s: float, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return result


def complete(url: str, max_tokens: int = 4, **kw) -> httpx.Response:
    # A client per call: a new connection, which the kernel may give to either API process.
    return httpx.post(f"{url}/v1/completions", headers=headers(), timeout=60, json={
        "model": MODEL_NAME, "prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **kw})


def chat_with_image(url: str, image) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=headers(), timeout=60, json={
        "model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                                  {"type": "image_url", "image_url": {"url": data_url(image)}}]}]})


@pytest.fixture(scope="module", autouse=True)
def reclaim_after_module():
    yield
    from moe.entrypoints.serve.api_server import _reclaim_leftovers

    _reclaim_leftovers()  # whatever a failed test's killed servers left


def first_tokens(url: str) -> float:
    """Requests that have produced their first token so far, as /metrics counts them (TTFT observations)."""
    text = httpx.get(f"{url}/metrics", headers=headers(), timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("moe:time_to_first_token_seconds_count"))


def both_api_processes_answer(url: str) -> bool:
    return {complete(url, max_tokens=1).headers["x-moe-api-server"] for _ in range(12)} == {"0", "1"}


def test_fallocate_enospc_is_a_refusal_not_an_error(monkeypatch):
    """The store itself: a reservation that fails is Refused.NO_SPACE (nothing written, nothing stored),
    and the store works again once /dev/shm has room."""
    import torch

    from moe.multimodal import shm_store
    from moe.multimodal.shm_store import Refused, SharedMemoryObjectStore

    full = []
    real = os.posix_fallocate

    def fallocate(fd, offset, length):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(shm_store.os, "posix_fallocate", fallocate)
    with SharedMemoryObjectStore(1 << 20, num_readers=1) as store:
        full.append(True)
        assert store.put("a", {"x": torch.ones(1000)}) is Refused.NO_SPACE
        assert store.num_objects == 0 and store.refused_no_space == 1
        full.clear()
        assert not isinstance(store.put("a", {"x": torch.ones(1000)}), Refused)


@pytest.fixture(scope="module")
def mm_server(tmp_path_factory):
    """A multimodal server whose pixels go through shared memory, able to make /dev/shm look full
    (see FULL_SHM_WRAPPER)."""
    folder = tmp_path_factory.mktemp("lifecycle_mm")
    mm_dir = save_llama4_mm_checkpoint(make_llama4_mm_model(seed=5), str(folder / "model"))
    wrapper = folder / "full_shm_serve.py"
    wrapper.write_text(FULL_SHM_WRAPPER)
    flag = folder / "shm_is_full"
    srv = Server(mm_dir, str(folder / "serve.log"), extra=SHM_FLAGS, launcher=[sys.executable, str(wrapper)],
                 env={FULL_FLAG_ENV: str(flag)})
    srv.full_flag = flag
    yield srv
    srv.stop()


def test_full_dev_shm_sends_images_inline_and_keeps_serving(mm_server):
    srv = mm_server
    first = chat_with_image(srv.url, picture(90, 60, 1))
    assert first.status_code == 200, first.text
    (segment,) = [p for p in leftovers([srv.proc.pid]) if p.startswith("/dev/shm/")]
    # /dev/shm fills up: reservations fail, and the pages not allocated yet are cut off (truncated),
    # so that touching one is the SIGBUS a full tmpfs gives. The stored image's pages stay.
    st = os.stat(segment)
    assert 0 < st.st_blocks * 512 < st.st_size, "the store is a sparse segment"
    os.truncate(segment, st.st_blocks * 512)
    srv.full_flag.touch()
    other = chat_with_image(srv.url, picture(120, 130, 6))  # a new image: no room, so inline
    assert other.status_code == 200, srv.read_log()
    assert other.json()["choices"][0]["finish_reason"] == "length"
    again = chat_with_image(srv.url, picture(90, 60, 1))  # the stored image, from shared memory
    assert again.status_code == 200 and again.json()["choices"] == first.json()["choices"]
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
    assert complete(srv.url).status_code == 200
    assert "/dev/shm is full: images go to the engine core inline" in srv.read_log()


def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        top = int(f.read())
    return next(p for p in range(top - 1, 1, -1) if not os.path.exists(f"/proc/{p}"))


@pytest.fixture(scope="module")
def owned_leftovers():
    """Things named as a server names them. Live: a core folder and a store of this (live) process,
    and a store named after a pid that is gone here but held (flock) by its writer, as a server in
    another pid namespace sharing /dev/shm would. Stale: a metrics folder of a pid that is gone."""
    import uuid

    from moe.multimodal.shm_store import SharedMemoryObjectStore

    folder = tempfile.mkdtemp(prefix=f"moe-core-{os.getpid()}-")
    mine = SharedMemoryObjectStore(1 << 16, num_readers=1, name=f"moe_mm_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    foreign = SharedMemoryObjectStore(1 << 16, num_readers=1, name=f"moe_mm_{_dead_pid()}_{uuid.uuid4().hex[:8]}")
    stale = tempfile.mkdtemp(prefix=f"moe-prometheus-{_dead_pid()}-")
    yield {"live": [folder, f"/dev/shm/{mine.name}", f"/dev/shm/{foreign.name}"], "stale": [stale]}
    mine.close()
    foreign.close()
    os.rmdir(folder)


@pytest.fixture(scope="module")
def two_api_servers(model_dir, tmp_path_factory, owned_leftovers):
    # Started by the reclaim test, after it killed mm_server.
    srv = Server(model_dir, str(tmp_path_factory.mktemp("log") / "serve2.log"),
                 extra=["--api-server-count", "2", "--shutdown-timeout", "1", "--max-model-len", "2048", *SHM_FLAGS])
    yield srv
    srv.stop()


def test_start_reclaims_what_a_killed_server_left_and_spares_live_ones(mm_server, owned_leftovers, request):
    pids = mm_server.pids()
    killed = leftovers(pids)
    mm_server.kill()  # the whole process group, as `kill -9 -PGID` does
    assert sum("/dev/shm/" in p for p in killed) == 1 and sum("moe-core-" in p for p in killed) == 1, killed
    assert set(leftovers(pids)) == set(killed), "a SIGKILLed process group leaves its folder and segment"
    request.getfixturevalue("two_api_servers")  # the next start
    # It removed all of that (its log is not checked for it: on a shared machine another server
    # starting meanwhile may have been first)...
    assert [p for p in killed + owned_leftovers["stale"] if os.path.exists(p)] == []
    # ... and nothing that a live process holds.
    assert all(os.path.exists(p) for p in owned_leftovers["live"])


def test_killed_api_process_is_restarted_and_the_other_serves_meanwhile(two_api_servers):
    srv = two_api_servers
    assert wait_for(lambda: both_api_processes_answer(srv.url), 60, poll_s=0.2), "both API processes serve"
    apis = srv.api_pids()
    assert len(apis) == 2
    os.kill(apis[0], signal.SIGKILL)
    assert wait_for(lambda: not _running(apis[0]), 5), "the launcher reaps its dead API process"
    for _ in range(6):  # while the replacement starts: the other API process answers
        r = complete(srv.url)
        assert r.status_code == 200, srv.read_log()
    assert srv.proc.poll() is None
    replacement = wait_for(lambda: [p for p in srv.api_pids() if p not in apis], 60)
    assert replacement, srv.read_log()
    assert wait_for(lambda: both_api_processes_answer(srv.url), 60, poll_s=0.2), srv.read_log()
    assert f"(pid {apis[0]}) exited (killed by SIGKILL): restarted it as pid {replacement[0]}" in srv.read_log()
    assert not leftovers([apis[0]]), "the dead API process's store is removed at once"


# Tokens of the long requests: at ~1.5 ms a token here (the tiny model, three requests), three times the drain.
LONG = 2000


def test_sigterm_drains_then_ends_the_rest_and_exits_clean(two_api_servers):
    """--shutdown-timeout 1: a short stream in flight finishes; a long stream ends with an error
    event and [DONE], a long request and one whose body never completes get a JSON 503; new requests
    get a JSON 503; the service exits within seconds, leaving nothing in /tmp or /dev/shm."""
    srv = two_api_servers
    pids = srv.pids()
    running = leftovers(pids)
    assert sum("moe-prometheus-" in p for p in running) == 1 and sum("/dev/shm/" in p for p in running) == 2, running
    got = {"long_stream": [], "short_stream": []}

    def stream(name, max_tokens):
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=headers(), timeout=60) as r:
            got[f"{name}_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got[name].append(line[len("data: "):])

    def long_request():
        got["long"] = complete(srv.url, max_tokens=LONG)

    started = first_tokens(srv.url)
    threads = [threading.Thread(target=stream, args=("long_stream", LONG)), threading.Thread(target=long_request),
               threading.Thread(target=stream, args=("short_stream", 20))]
    for t in threads:
        t.start()
    stalled = socket.create_connection(("127.0.0.1", srv.port), timeout=15)  # its body stops after a byte
    stalled.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode())
    assert wait_for(lambda: len(got["long_stream"]) > 2 and got["short_stream"], 30), "the streams started"
    # the long request too is in the engine before the signal (on a loaded machine it can lag the streams)
    assert wait_for(lambda: first_tokens(srv.url) >= started + 3, 30), "the three requests run"
    sent_at = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)

    def refused():
        try:
            r = complete(srv.url, max_tokens=1)
        except httpx.HTTPError:
            return None
        return [r] if r.status_code == 503 else None

    (new,) = wait_for(refused, 5, poll_s=0.05) or [None]
    assert new is not None, "a new request during the drain gets a 503"
    refusal = new.json()["error"]
    assert refusal["type"] == "ServiceUnavailableError" and "shutting down" in refusal["message"]
    for t in threads:
        t.join(30)
    answer = b""
    while chunk := stalled.recv(65536):
        answer += chunk
    stalled.close()
    assert answer.startswith(b"HTTP/1.1 503 ") and b"ServiceUnavailableError" in answer, answer
    assert got["short_stream"][-1] == "[DONE]"
    assert json.loads(got["short_stream"][-2])["usage"]["completion_tokens"] == 20, "finished within the drain"
    assert got["long"].status_code == 503 and got["long"].headers["content-type"] == "application/json"
    assert got["long"].json()["error"]["code"] == 503 and "--shutdown-timeout" in got["long"].json()["error"]["message"]
    events = got["long_stream"]
    assert got["long_stream_status"] == 200 and events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert 2 < len(events) < LONG, "the stream was cut short"
    assert srv.proc.wait(15) == 0
    assert time.monotonic() - sent_at < 10
    assert wait_for(lambda: not any(_running(p) for p in pids), 10), "every process of the service exits"
    assert leftovers(pids) == []
