"""`moe serve` with images: /v1/chat/completions with image_url parts (base64 data URLs) on a tiny
random multimodal Llama-4 against the offline LLM.chat; the processor cache and the IPC cache hit
on a repeated image (counted in /metrics) without changing the answer; bad images are 400s."""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from moe import LLM, SamplingParams
from tests.factories_llama4_mm import data_url, make_llama4_mm_model, picture, save_llama4_mm_checkpoint
from tests.serve.helpers import API_KEY, ENGINE_ARGS, MODEL_NAME, ServerProcess, scrape_metrics


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory):
    return save_llama4_mm_checkpoint(make_llama4_mm_model(seed=5), str(tmp_path_factory.mktemp("mm_serve")))


@pytest.fixture(scope="module")
def server(mm_dir, tmp_path_factory):
    srv = ServerProcess(mm_dir, str(tmp_path_factory.mktemp("log") / "serve.log"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=60.0, max_retries=0)


def conversation(*images) -> list[dict]:
    parts = [{"type": "text", "text": "Compare "}]
    for image in images:
        parts += [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": " with "}]
    return [{"role": "user", "content": parts}]


def test_chat_with_images_equals_offline_and_repeats_hit_the_caches(server, client, mm_dir):
    convs = [conversation(picture(90, 60, 1)), conversation(picture(40, 200, 2), picture(56, 56, 3)),
             conversation(picture(90, 60, 1))]  # the first image again: both caches hit
    before = scrape_metrics(server.url)
    texts = [client.chat.completions.create(model=MODEL_NAME, messages=c, max_tokens=6, temperature=0.0,
                                            extra_body={"ignore_eos": True}).choices[0].message.content
             for c in convs]
    after = scrape_metrics(server.url)
    with LLM(mm_dir, **ENGINE_ARGS) as llm:
        want = [o.outputs[0].text for o in llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=6,
                                                                         ignore_eos=True), use_tqdm=False)]
    assert texts == want
    assert texts[0] == texts[2]

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("moe:mm_cache_queries_total") == 4 and delta("moe:mm_cache_hits_total") == 1
    assert delta("moe:mm_ipc_cache_queries_total") == 4 and delta("moe:mm_ipc_cache_hits_total") == 1


@pytest.mark.parametrize("url,match", [
    ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot decode"),
    ("https://example.com/cat.png", "network"),
    ("data:image/png;base64,***", "base64"),
])
def test_bad_image_is_a_400_naming_the_problem(server, client, url, match):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what?"}]}]
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    # The server goes on serving images.
    ok = client.chat.completions.create(model=MODEL_NAME, messages=conversation(picture(30, 30, 4)), max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def shm_server(mm_dir, tmp_path_factory):
    """Pixels through shared memory to two tensor-parallel workers, which read them themselves; a
    store of ~200 KB (two or three images) so that pinned images fill it and others go inline."""
    srv = ServerProcess(mm_dir, str(tmp_path_factory.mktemp("log") / "serve_shm.log"),
                        extra=["--mm-processor-cache-type", "shm", "--mm-processor-cache-gb", "0.0002",
                               "--tensor-parallel-size", "2"])
    yield srv
    srv.stop()


def shm_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("moe_mm_")}


def test_shared_memory_pixels_give_offline_answers(shm_server, mm_dir):
    client = openai.OpenAI(base_url=f"{shm_server.url}/v1", api_key=API_KEY, timeout=60.0, max_retries=0)
    convs = [conversation(picture(90, 60, 1)), conversation(picture(40, 200, 2), picture(56, 56, 3)),
             conversation(picture(90, 60, 1)), conversation(picture(120, 130, 6), picture(30, 80, 7))]
    assert shm_segments(), "the API process keeps its store in /dev/shm"
    before = scrape_metrics(shm_server.url)

    def ask(c):
        return client.chat.completions.create(model=MODEL_NAME, messages=c, max_tokens=6, temperature=0.0,
                                              extra_body={"ignore_eos": True}).choices[0].message.content

    # One after the other: the second request re-references the stored image (a hit, no new bytes).
    first, again = ask(convs[0]), ask(convs[0])
    after = scrape_metrics(shm_server.url)
    assert after["moe:mm_ipc_cache_hits_total"] - before.get("moe:mm_ipc_cache_hits_total", 0.0) == 1
    with ThreadPoolExecutor(4) as pool:  # concurrent: pinned images fill the small store, some go inline
        texts = list(pool.map(ask, convs + convs))
    with LLM(mm_dir, **ENGINE_ARGS) as llm:
        want = [o.outputs[0].text for o in llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=6,
                                                                         ignore_eos=True), use_tqdm=False)]
    assert [first, again] == want[:1] * 2
    assert texts == want + want


def test_stopped_server_leaves_no_shared_memory(mm_dir, tmp_path):
    before = shm_segments()
    srv = ServerProcess(mm_dir, str(tmp_path / "serve.log"), extra=["--mm-processor-cache-type", "shm"])
    try:
        assert shm_segments() - before
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while shm_segments() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not shm_segments() - before
