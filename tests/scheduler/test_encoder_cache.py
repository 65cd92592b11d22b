"""The encoder budget in the scheduler: every chunk that touches an image's tokens finds that image's
features computed (this step or earlier, never twice), the runner's holdings never exceed the
capacity, everything is freed at the end; and image hashes key the prefix cache."""
from __future__ import annotations

import random

import pytest
import torch

from moe.multimodal.inputs import ImageItem
from scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from tests.scheduler.factories import assert_all_blocks_free, check_invariants, fake_tokens


def make_scheduler(capacity: int, **kw) -> Scheduler:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, block_size=4, num_blocks=40,
               encoder_cache_size=capacity)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def image(offset: int, length: int, num_embeds: int, key: str = "img") -> ImageItem:
    return ImageItem(key, offset, length, num_embeds, torch.empty(0))


def image_request(req_id: str, rng: random.Random, max_images: int = 3) -> Request:
    """A prompt of text and images at random places; image spans of 3-24 tokens."""
    tokens, items = [], []
    for _ in range(rng.randint(0, max_images)):
        tokens += [rng.randrange(1, 50) for _ in range(rng.randint(0, 6))]
        length = rng.randint(3, 24)
        items.append(image(len(tokens), length, rng.randint(1, length - 2), key=f"h{rng.randrange(4)}"))
        tokens += [99] * length
    tokens += [rng.randrange(1, 50) for _ in range(rng.randint(1, 6))]
    return Request(req_id, tokens, max_tokens=rng.randint(1, 6), mm_items=items)


class FakeRunner:
    """What the model runner holds, driven only by the scheduler's outputs; checks every chunk."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.held: dict[tuple[str, int], int] = {}
        self.encoded: list[tuple[str, int]] = []

    def step(self, so) -> None:
        for key in so.free_encoder_inputs:
            assert key in self.held, f"freed {key}, which the runner does not hold"
            del self.held[key]
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            for key in [k for k in self.held if k[0] == req_id]:
                del self.held[key]
        for req_id, indices in so.scheduled_encoder_inputs.items():
            for i in indices:
                assert (req_id, i) not in self.held, f"image {i} of {req_id} encoded while held"
                self.held[(req_id, i)] = self.sched.requests[req_id].mm_items[i].num_embeds
                self.encoded.append((req_id, i))
        assert sum(self.held.values()) <= self.sched.encoder.capacity
        for req_id, n in so.num_scheduled_tokens.items():
            r = self.sched.requests[req_id]
            end = r.num_computed_tokens            # already advanced by the scheduler
            start = end - n
            for i, item in enumerate(r.mm_items):
                if item.overlaps(start, end):
                    assert (req_id, i) in self.held, f"{req_id}'s chunk [{start}, {end}) reads image {i} unheld"


@pytest.mark.parametrize("seed,capacity,budget", [(0, 24, 16), (1, 30, 8), (2, 24, 48), (3, 24, 4), (4, 40, 64)])
def test_every_chunk_finds_its_images(seed, capacity, budget):
    rng = random.Random(seed)
    sched = make_scheduler(capacity, max_num_batched_tokens=budget, num_blocks=24 if seed % 2 else 40)
    runner = FakeRunner(sched)
    reqs = [image_request(f"r{i}", rng) for i in range(12)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        check_invariants(sched, so, [])  # long prefill chunks take the budget: no decode-first check
        runner.step(so)
        sched.update_from_output(so, fake_tokens(so, sched))
        if rng.random() < 0.03 and sched.requests:
            sched.finish_requests(rng.choice(sorted(sched.requests)), RequestStatus.FINISHED_ABORTED)
    else:
        raise AssertionError("the scheduler did not finish")
    assert_all_blocks_free(sched)
    assert sched.encoder.used == 0
    runner.step(sched.schedule())  # the last frees reach the runner
    assert not runner.held
    # Without preemption, each image is encoded exactly once.
    if not sched.num_preemptions:
        assert len(runner.encoded) == len(set(runner.encoded))


def test_chunk_stops_before_an_image_that_does_not_fit():
    sched = make_scheduler(10, max_num_batched_tokens=64)
    a = Request("a", [1] * 4 + [99] * 10 + [2] * 3, max_tokens=3, mm_items=[image(4, 10, 8)])
    b = Request("b", [3] * 6 + [99] * 5 + [4], max_tokens=1, mm_items=[image(6, 5, 4)])
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    # a's image (8) fills the cache beyond what b's (4) needs: b computes its text up to the image.
    assert so.num_scheduled_tokens == {"a": 17, "b": 6}
    assert so.scheduled_encoder_inputs == {"a": [0]}
    sched.update_from_output(so, fake_tokens(so, sched))
    so = sched.schedule()  # a's image is passed and freed: b's fits now
    assert so.free_encoder_inputs == [("a", 0)]
    assert so.scheduled_encoder_inputs == {"b": [0]}
    assert so.num_scheduled_tokens["b"] == 6


def test_image_larger_than_the_cache_is_refused():
    sched = make_scheduler(4)
    with pytest.raises(ValueError, match="more than the encoder cache holds"):
        sched.add_request(Request("a", [99] * 8, max_tokens=1, mm_items=[image(0, 8, 6)]))


def test_images_need_an_encoder():
    sched = make_scheduler(0)
    with pytest.raises(ValueError, match="runs no image encoder"):
        sched.add_request(Request("a", [99] * 8, max_tokens=1, mm_items=[image(0, 8, 6)]))


def test_without_chunking_every_image_of_the_prompt_is_encoded_in_one_step():
    sched = make_scheduler(30, max_num_batched_tokens=96, enable_chunked_prefill=False)
    r = Request("a", [1] * 3 + [99] * 12 + [2] * 2 + [99] * 9 + [5], max_tokens=1,
                mm_items=[image(3, 12, 10), image(17, 9, 7)])
    sched.add_request(r)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 27} and so.scheduled_encoder_inputs == {"a": [0, 1]}


@pytest.mark.parametrize("same_image", [True, False])
def test_prefix_cache_keys_include_the_image_hash(same_image):
    """Same tokens, different images: no block holding image tokens is shared."""
    sched = make_scheduler(64, max_num_batched_tokens=64)
    tokens = [1, 2, 3, 4] + [99] * 12 + [7, 8, 9, 10, 11]
    first = Request("a", tokens, max_tokens=1, mm_items=[image(4, 12, 10, key="cat")])
    sched.add_request(first)
    so = sched.schedule()
    sched.update_from_output(so, fake_tokens(so, sched))
    second = Request("b", tokens, max_tokens=1, mm_items=[image(4, 12, 10, key="cat" if same_image else "dog")])
    sched.add_request(second)
    so = sched.schedule()
    # The first block is text only and shared either way; the image's blocks only with the same image.
    assert second.num_cached_tokens == (20 if same_image else 4)
    # A hit inside the image's span still encodes it (its features fill the rest of the span)...
    assert so.scheduled_encoder_inputs == ({} if same_image else {"b": [0]})
