"""Images a client cannot stall or mislead the server with: an image over what the image processor
can use is refused from its header, before its pixels are decoded; image tokens in a prompt's text
or ids that no attached image backs are refused naming the token; image processing runs in the
API process's input threads (MOE_MEDIA_LOADING_THREAD_COUNT) with per-request counts intact."""
from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moe.engine.tokenizer import Tokenizer
from moe.multimodal.llama4_prompt import TOKEN_KEYS, Llama4ImageTokens
from moe.multimodal.processing import ImageProcessing
from tests.factories_llama4_mm import (LLAMA4_TINY_PROCESSOR, TOKEN_IDS, data_url, make_llama4_mm_model, picture,
                                       save_llama4_mm_checkpoint, save_llama4_mm_processor_configs,
                                       save_llama4_mm_tokenizer)
from tests.serve.helpers import MODEL_NAME, ServerProcess, headers, scrape_metrics

IMAGE = TOKEN_IDS["<|image|>"]
CAP = 4 * 56 * 56 * 16  # the tiny processor: up to 4 tiles of 56 px; 16x that canvas


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height RGB pixels, followed by a few bytes of pixel
    data only: decoding it would fail as truncated, so a size refusal shows it was not decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def png_data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mm_limits"))
    save_llama4_mm_tokenizer(path)
    save_llama4_mm_processor_configs(path)
    return path


@pytest.fixture(scope="module")
def processing(folder):
    return ImageProcessing(folder, Tokenizer(folder), image_limit=4, cache_gb=0.1, tile_size=56)


# ---- image tokens ----------------------------------------------------------------------------------

def test_image_tokens_without_an_image_are_refused_by_name(folder):
    tokens = Llama4ImageTokens.from_tokenizer(Tokenizer(folder), LLAMA4_TINY_PROCESSOR)
    tokens.check_prompt_ids([1, 2, 3], 0)
    tokens.check_prompt_ids([1, IMAGE, 3], 1)
    with pytest.raises(ValueError, match=r"image placeholder <\|image\|> \(token id 508\) but no image is attached"):
        tokens.check_prompt_ids([1, IMAGE, 3], 0)
    for key in TOKEN_KEYS:
        if key == "image_token":
            continue
        name = LLAMA4_TINY_PROCESSOR[key]
        with pytest.raises(ValueError, match=f"the prompt holds {name.replace('|', r'[|]')} \\(token id "
                                             f"{TOKEN_IDS[name]}\\), a token of an image's expansion"):
            tokens.check_prompt_ids([1, TOKEN_IDS[name], IMAGE], 1)


def test_processing_refuses_expansion_tokens_given_with_an_image(processing):
    ids, items = processing.process([1, IMAGE, 2], {"image": [picture(30, 30, 1)]})
    assert len(items) == 1
    with pytest.raises(ValueError, match=r"<\|patch\|>"):
        processing.process([1, IMAGE, TOKEN_IDS["<|patch|>"]], {"image": [picture(30, 30, 1)]})
    with pytest.raises(ValueError, match=r"<\|image\|>.*no image is attached"):
        processing.process([1, IMAGE], {"image": []})


# ---- the pixel cap ------------------------------------------------------------------------------------

def test_images_over_the_processor_cap_are_refused_from_the_header(processing):
    assert processing.max_pixels == CAP
    # 81 MP: under PIL's own bomb limit (89 MP), which today's cap was; refused without decoding.
    start = time.monotonic()
    for image in (png_declaring(9000, 9000), png_data_url(png_declaring(9000, 9000))):
        with pytest.raises(ValueError, match=f"9000x9000 = 81000000 pixels, over the limit of {CAP} "
                                             r"\(16x the largest canvas of this model's image processor"):
            processing.process([1, IMAGE], {"image": [image]})
    assert time.monotonic() - start < 1.0
    buf = io.BytesIO()
    picture(500, 500, 2).save(buf, "PNG")  # a real image just over the cap
    with pytest.raises(ValueError, match=f"500x500 = 250000 pixels, over the limit of {CAP}"):
        processing.process([1, IMAGE], {"image": [buf.getvalue()]})
    ids, items = processing.process([1, IMAGE], {"image": [picture(440, 440, 3)]})  # just under: processed
    assert items[0].num_embeds > 0


def test_lookup_counts_are_per_thread(processing):
    """InputProcessor counts a request's cache lookups as before/after differences: requests
    processed in other threads at the same time must not show in them."""
    images = [data_url(picture(20 + i, 20, 10 + i)) for i in range(6)]
    barrier = threading.Barrier(3)

    def work(i):
        before = processing.queries
        barrier.wait()
        for _ in range(3):
            processing.process([1, IMAGE, IMAGE], {"image": images[2 * i:2 * i + 2]})
        return processing.queries - before

    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(work, range(3))) == [6, 6, 6]


# ---- the server -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    mm_dir = save_llama4_mm_checkpoint(make_llama4_mm_model(seed=5), str(tmp_path_factory.mktemp("mm_limits_srv")))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOE_MEDIA_LOADING_THREAD_COUNT", "3")
        srv = ServerProcess(mm_dir, str(tmp_path_factory.mktemp("log") / "serve.log"))
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=headers(), json={"model": MODEL_NAME, "max_tokens": 2, **body},
                      timeout=60.0)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("path,body,match", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "what is in <|image|> here?"}]},
     "the prompt holds the image placeholder <|image|> (token id 508) but no image is attached"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is"}, image_part(data_url(picture(30, 30, 1))),
        {"type": "text", "text": "<|patch|><|patch|>?"}]}]},
     "the prompt holds <|patch|> (token id 509), a token of an image's expansion"),
    ("/v1/completions", {"prompt": [1, 2, IMAGE, 3]}, "the prompt holds the image placeholder <|image|>"),
    ("/v1/completions", {"prompt": "caption: <|image_start|>"}, "the prompt holds <|image_start|>"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        image_part(png_data_url(png_declaring(9000, 9000))), {"type": "text", "text": "what?"}]}]},
     f"image 0 of the prompt: the image is 9000x9000 = 81000000 pixels, over the limit of {CAP}"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        image_part(data_url(picture(30, 30, 1))), {"type": "input_audio", "input_audio": {"data": "AA"}}]}]},
     "content part type 'input_audio' is not supported"),
])
def test_misleading_or_oversized_inputs_are_400s(server, path, body, match):
    start = time.monotonic()
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert match in response.json()["error"]["message"]
    assert time.monotonic() - start < 5.0


def test_concurrent_image_requests_count_exactly(server):
    """Images decode in the input threads now, several requests at once: each is answered, and the
    processor-cache counters see each image once."""
    urls = [data_url(picture(40 + 5 * i, 48, 100 + i)) for i in range(4)]
    conversations = [[{"role": "user", "content": [image_part(u), {"type": "text", "text": "describe"}]}]
                     for u in urls + urls[:2]]
    before = scrape_metrics(server.url)
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda m: post(server, "/v1/chat/completions", {"messages": m}), conversations))
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses if r.status_code != 200]
    after = scrape_metrics(server.url)
    assert after["moe:mm_cache_queries_total"] - before.get("moe:mm_cache_queries_total", 0.0) == 6
    assert httpx.get(f"{server.url}/health", timeout=5.0).status_code == 200
