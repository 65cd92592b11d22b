"""Keys-only API side of the IPC cache (moe serve, one engine core): the API process keeps no
pixels, a repeated image skips the processor as a shape-only item and travels as its hash, and an
image whose key was evicted between processing and sending is processed again; the core always
resolves the pixels a fresh processing gives."""
from __future__ import annotations

import pytest
import torch

from moe.engine.core import CoreRequest
from moe.engine.serialization import decode, encode, pack_request, unpack_request
from moe.engine.tokenizer import Tokenizer
from moe.multimodal.processing import ImageProcessing
from moe.multimodal.processor_cache import ReceiverCache, SenderCache
from moe.sampling_params import SamplingParams
from tests.factories_llama4_mm import TOKEN_IDS, picture, save_llama4_mm_processor_configs, save_llama4_mm_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mm_keys_only"))
    save_llama4_mm_tokenizer(path)
    save_llama4_mm_processor_configs(path)
    return path


def processing(folder: str, sender: SenderCache | None) -> ImageProcessing:
    proc = ImageProcessing(folder, Tokenizer(folder), image_limit=4, cache_gb=1.0, tile_size=56)
    if sender is not None:
        proc.use_keys_only(sender)
    return proc


def request(rid: str, items) -> CoreRequest:
    return CoreRequest(rid, [1] * 200, 4, SamplingParams(max_tokens=4), (0,), items)


def send(proc: ImageProcessing, sender: SenderCache, receiver: ReceiverCache, rid: str, images: list):
    ids, items = proc.process([1, TOKEN_IDS["<|image|>"]] * len(images), {"image": images})
    proc.restore_evicted(items, sender)
    return items, unpack_request(decode(encode(pack_request(request(rid, items), sender))), receiver)


def test_repeats_travel_as_hashes_and_evicted_keys_are_processed_again(folder):
    image_bytes = 4 * 3 * 56 * 56 * 2 + 3 * 56 * 56 * 2  # up to 4 tiles + global, bf16
    sender, receiver = SenderCache(2 * image_bytes), ReceiverCache(2 * image_bytes)
    proc, plain = processing(folder, sender), processing(folder, None)
    a, b, c = picture(100, 100, 1), picture(90, 40, 2), picture(60, 150, 3)

    def expected(image):
        return plain.process([TOKEN_IDS["<|image|>"]], {"image": image})[1][0].pixel_values

    _, got = send(proc, sender, receiver, "r0", [a])
    assert torch.equal(got.mm_items[0].pixel_values, expected(a))
    # A again: processed as a hit (shape only, no pixels kept here), sent as its hash alone.
    ids, items = proc.process([TOKEN_IDS["<|image|>"]], {"image": a})
    assert items[0].pixel_values.is_meta and proc.hits == 1
    # Meanwhile two other images go to the core and evict A's key on both sides.
    send(proc, sender, receiver, "r1", [b])
    send(proc, sender, receiver, "r2", [c])
    assert items[0].mm_hash not in sender and items[0].mm_hash not in receiver
    proc.restore_evicted(items, sender)  # what the API process does right before sending
    assert not items[0].pixel_values.is_meta
    got = unpack_request(decode(encode(pack_request(request("r3", items), sender))), receiver)
    assert torch.equal(got.mm_items[0].pixel_values, expected(a))
    # And a hit that is still held resolves on the core's side.
    _, got = send(proc, sender, receiver, "r4", [a])
    assert sender.hits == 1 and torch.equal(got.mm_items[0].pixel_values, expected(a))
