"""Chat templates a client cannot stall, crash or blow up the server with: a hostile template aborts
within its time and size bounds (in-process checks; under `moe serve` also a renderer process that
is killed at its deadline), every template problem is a ValueError offline and a 400 naming it on
the server, and while a template renders or a long prompt is tokenised /health still answers."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from moe.engine import template_renderers
from moe.engine.chat_template import (MAX_OUTPUT_ENV, MAX_SOURCE_ENV, TIMEOUT_ENV, ChatTemplate, TemplateLimits,
                                      check_messages, check_template_kwargs, template_limits)
from moe.entrypoints.serve.async_llm import media_loading_thread_count
from tests.serve.helpers import MODEL_NAME, ServerProcess, headers

MESSAGES = [{"role": "user", "content": "Hello there"}]
SERVER_TIMEOUT_S = 1.5  # the template time bound of the test server
NESTED_LOOPS = "{% for a in range(10**5) %}{% for b in range(10**5) %}{% endfor %}{% endfor %}"
BIG = "{% set big = 'x' * 1000000 %}"


def render(source: str, limits: TemplateLimits | None = None, **kwargs) -> str:
    return ChatTemplate(source, {"bos_token": "<s>"}, limits=limits).render(MESSAGES, **kwargs)


# ---- in-process bounds ----------------------------------------------------------------------------

@pytest.mark.parametrize("source,match", [
    ("{{ 'x' * 10**7 }}", "a string of 10000000 characters with \\*"),
    (NESTED_LOOPS, "took longer than 0.5 s"),
    (NESTED_LOOPS.replace("{% endfor %}{% endfor %}", "y{% endfor %}{% endfor %}"), "took longer than 0.5 s"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}", "a string of 8388608 characters with ~"),
    ("{% set ns = namespace(s=['x']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "a list of .* items with \\+"),
    ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "integer"),
    ("{{ 'x'|center(10**9) }}", "center filter width of 1000000000"),
    ("{{ '{:>999999999}'.format(1) }}", "str.format width of 999999999"),
    ("{{ '%999999999d' % 1 }}", "%-format width"),
    (BIG + "{{ big.replace('x', 'xxxxxxxxxx') }}", "with replace"),
    (BIG + "{% set out %}{% for i in range(100000) %}{{ big }}{% endfor %}{% endset %}", "output of"),
    ("{% set big = range(100000)|list %}{{ [big] * 100000 }}", "a list of .* items with \\*"),
    ("{{ ([[1]] * 1000)|sum(start=[]) }}", "sum filter"),
])
def test_hostile_template_aborts_within_its_bounds(source, match):
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"^the chat template .*{match}"):
        render(source, TemplateLimits(timeout_s=0.5))
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("source,match", [
    ("{% for %}", "syntax error at line 1"),
    ("{{ messages|nosuch }}", "No filter named 'nosuch'"),
    ("{% include 'other.jinja' %}", "uses {% include %}"),
    ("{% import 'macros.jinja' as m %}", "uses {% import %}"),
    ("{% from 'macros.jinja' import f %}", "uses {% from ... import %}"),
    ("{% extends 'base.jinja' %}", "uses {% extends %}"),
    ("{% for i in range(10**6) %}{% endfor %}", "Range too big"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "nests too deeply"),
    ("{% if 1 %}" * 200 + "x" + "{% endif %}" * 200, "nests too deeply"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ raise_exception('no tools here') }}", "no tools here"),
    ("x" * (200 << 10), f"more than the limit of {128 << 10} \\({MAX_SOURCE_ENV}\\)"),
    ("{{ '\ud800' }}", "not valid Unicode"),
])
def test_template_errors_are_value_errors_naming_the_problem(source, match):
    with pytest.raises(ValueError, match=match):
        render(source)


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "bos_token", "chat_template"])
def test_colliding_template_kwargs_are_refused(key):
    with pytest.raises(ValueError, match=f"chat_template_kwargs cannot set '{key}'"):
        check_template_kwargs({key: "x", "enable_thinking": True})
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set 'eos_token'"):
        render("{{ messages[0].content }}", eos_token="x")
    assert render("{{ messages[0].content }} {{ enable_thinking }}", enable_thinking=True) == "Hello there True"


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                                  {"type": "file", "file": {"file_data": "AAAA"}}])
def test_unsupported_content_parts_are_refused_by_name(part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "listen"}, part]}]
    with pytest.raises(ValueError, match=f"^content part type '{part['type']}' is not supported"):
        check_messages(messages)
    with pytest.raises(ValueError, match="needs|must be a content part"):
        check_messages([{"role": "user", "content": ["just a string"]}])


def test_limits_and_thread_count_from_the_environment():
    assert template_limits({}) == TemplateLimits(5.0, 4 << 20, 128 << 10)
    assert template_limits({TIMEOUT_ENV: "0.25", MAX_OUTPUT_ENV: "1000", MAX_SOURCE_ENV: "50"}) == \
        TemplateLimits(0.25, 1000, 50)
    with pytest.raises(ValueError, match=TIMEOUT_ENV):
        template_limits({TIMEOUT_ENV: "soon"})
    with pytest.raises(ValueError, match=MAX_OUTPUT_ENV):
        template_limits({MAX_OUTPUT_ENV: "0"})
    with pytest.raises(ValueError, match="more than the limit of 10"):
        render("{{ 'x' * 11 }}", template_limits({MAX_OUTPUT_ENV: "10"}))
    assert media_loading_thread_count({}) == 8
    assert media_loading_thread_count({"VLLM_MEDIA_LOADING_THREAD_COUNT": "3"}) == 3
    assert media_loading_thread_count({"MOE_MEDIA_LOADING_THREAD_COUNT": "2",
                                       "VLLM_MEDIA_LOADING_THREAD_COUNT": "3"}) == 2
    with pytest.raises(ValueError, match="MOE_MEDIA_LOADING_THREAD_COUNT"):
        media_loading_thread_count({"MOE_MEDIA_LOADING_THREAD_COUNT": "-1"})


# ---- renderer processes (what `moe serve` uses) ------------------------------------------------------

@pytest.fixture
def renderers():
    template_renderers.use_renderer_processes(1)
    yield
    template_renderers.stop_renderer_processes()


# One C call (a sort of 5M strings, ~15 s) that no check between steps can interrupt: in a thread
# it would hold the GIL, and the event loop, throughout.
ONE_LONG_CALL = "{{ ((range(100000)|map('string')|list) * 50)|sort|length }}"


def test_renderer_process_is_killed_at_its_deadline(renderers):
    limits = TemplateLimits(timeout_s=0.5, max_output_chars=1 << 28)
    assert render("{{ bos_token }}{{ messages[0].content }}") == "<s>Hello there"  # starts the renderer
    start = time.monotonic()
    with pytest.raises(ValueError, match="took longer than 0.5 s to render"):
        render(ONE_LONG_CALL, limits)
    assert time.monotonic() - start < 2.0
    # A fresh renderer takes the next template; a memory bomb there is capped (RLIMIT_AS).
    with pytest.raises(ValueError, match="out of memory"):
        render("{{ ('x' * 3000000000)|length }}", TemplateLimits(max_output_chars=1 << 32))
    assert render("{{ bos_token }}{{ messages[0].content }}") == "<s>Hello there"
    with pytest.raises(ValueError, match="syntax error"):
        render("{% for %}")


# ---- offline ----------------------------------------------------------------------------------------

def test_offline_chat_raises_value_errors(llm):
    with pytest.raises(ValueError, match="syntax error at line 1"):
        llm.chat(MESSAGES, chat_template="{% for %}", use_tqdm=False)
    with pytest.raises(ValueError, match="cannot set 'eos_token'"):
        llm.chat(MESSAGES, chat_template_kwargs={"eos_token": "x"}, use_tqdm=False)
    with pytest.raises(ValueError, match="content part type 'input_audio' is not supported"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], use_tqdm=False)


# ---- the server -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TIMEOUT_ENV, str(SERVER_TIMEOUT_S))
        srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "serve.log"))
    yield srv
    srv.stop()


def post(server, path: str, body: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=headers(), json={"model": MODEL_NAME, "max_tokens": 2, **body},
                      timeout=timeout)


def health_while(server, request) -> tuple[httpx.Response, list[float], float]:
    """request() in a thread; meanwhile /health, again and again: (its response, the /health latencies, its time)."""
    out = {}

    def run():
        start = time.monotonic()
        out["response"] = request()
        out["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=run)
    thread.start()
    latencies = []
    time.sleep(0.2)  # the request is in
    while thread.is_alive():
        start = time.monotonic()
        try:
            assert httpx.get(f"{server.url}/health", timeout=5.0).status_code == 200
        finally:
            latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    thread.join()
    return out["response"], latencies, out["elapsed"]


def test_health_answers_while_a_hostile_template_renders(server):
    response, latencies, elapsed = health_while(server, lambda: post(server, "/v1/chat/completions", {
        "messages": MESSAGES, "chat_template": NESTED_LOOPS}))
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(
        f"the chat template took longer than {SERVER_TIMEOUT_S:g} s to render")
    assert elapsed < SERVER_TIMEOUT_S + 2.0
    assert latencies and max(latencies) < 1.0


def test_health_answers_while_a_long_prompt_is_tokenised(server):
    prompt = "hello world " * 170_000  # 2 MB: ~2 s to tokenise
    response, latencies, _ = health_while(server, lambda: post(server, "/v1/completions", {"prompt": prompt}))
    assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"]
    assert len(latencies) >= 3 and max(latencies) < 1.0


@pytest.mark.parametrize("body,match", [
    ({"chat_template": "{{ 'x' * 10**7 }}"}, "the chat template would build a string of 10000000 characters"),
    ({"chat_template": "{% for m in messages %}"}, "the chat template has a syntax error"),
    ({"chat_template": "{{ messages|nosuch }}"}, "No filter named 'nosuch'"),
    ({"chat_template": "{% include 'x' %}"}, "the chat template uses {% include %}"),
    ({"chat_template": "{% extends 'x' %}"}, "the chat template uses {% extends %}"),
    ({"chat_template": "{% for i in range(10**6) %}{% endfor %}"}, "Range too big"),
    ({"chat_template": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"}, "the chat template recursed too deeply"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs cannot set 'messages'"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs cannot set 'add_generation"),
    ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs cannot set 'bos_token'"),
    ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs cannot set 'chat_template'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]},
     "content part type 'input_audio' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
     "content part type 'video_url' is not supported"),
])
def test_template_problems_are_400s_naming_them(server, body, match):
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, **body}, timeout=30.0)
    assert response.status_code == 400, response.text
    assert match in response.json()["error"]["message"]


def test_server_renders_templates_and_keeps_serving(server):
    response = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "you"}]}],
        "chat_template": "{% for m in messages %}{{ m.role }}> {{ m.content }}|{{ mood }}\n{% endfor %}",
        "chat_template_kwargs": {"mood": "calm"}, "echo": False, "logprobs": False})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 3


def test_sigterm_stops_the_server_while_a_hostile_template_renders(server):
    """Keep last: it stops the module's server."""
    def hostile():
        try:
            post(server, "/v1/chat/completions", {"messages": MESSAGES, "chat_template": NESTED_LOOPS})
        except httpx.HTTPError:
            pass  # the server went away first

    thread = threading.Thread(target=hostile)
    thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    server.proc.terminate()
    server.proc.wait(SERVER_TIMEOUT_S + 5.0)  # TimeoutExpired: it did not stop
    assert time.monotonic() - start < SERVER_TIMEOUT_S + 5.0
    thread.join(10)
