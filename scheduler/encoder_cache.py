"""The encoder budget: which images' encoder outputs the model runner holds, counted in embeddings.

An image's features are computed once, in the step whose chunk first reaches its tokens, and the
runner keeps them until the request's computed tokens pass the image's end (a chunk boundary may
cut through an image's tokens: the next chunk reads the rest of the kept features). The scheduler
mirrors what the runner holds so that the total stays within `capacity` embeddings, and tells the
runner which entries to drop (`SchedulerOutput.free_encoder_inputs`).

The capacity is at least the largest single image, so an image alone always fits; a chunk that
would need an image the cache cannot take now stops before that image's tokens.

Items are the request's `mm_items` (moe/multimodal/inputs.py's ImageItem: offset, length,
num_embeds), in prompt order.
"""
from __future__ import annotations

from scheduler.request import Request


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the encoder cache capacity must be >= 1 embedding, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._held: dict[str, dict[int, int]] = {}  # request id -> {item index: embeddings}
        self._to_free: list[tuple[str, int]] = []    # dropped since the last step, for the runner

    def holds(self, request: Request, index: int) -> bool:
        return index in self._held.get(request.request_id, ())

    def plan(self, request: Request, start: int, num_new: int, budget: int) -> tuple[int, list[int]]:
        """The request's chunk [start, start + num_new) cut so that every image it touches is
        either held or computed now within `budget` embeddings of encoder work and the free
        capacity: (tokens to schedule, possibly <= 0; indices of the images to encode)."""
        end = start + num_new
        free = self.capacity - self.used
        to_encode: list[int] = []
        for index, item in enumerate(request.mm_items):
            if item.offset >= end:
                break
            if item.end <= start or self.holds(request, index):
                continue
            if item.num_embeds > min(budget, free):
                return item.offset - start, to_encode
            budget -= item.num_embeds
            free -= item.num_embeds
            to_encode.append(index)
        return num_new, to_encode

    def allocate(self, request: Request, indices: list[int]) -> None:
        held = self._held.setdefault(request.request_id, {})
        for index in indices:
            n = request.mm_items[index].num_embeds
            held[index] = n
            self.used += n

    def free_passed(self, request: Request) -> None:
        """Drop the images whose tokens are all computed."""
        held = self._held.get(request.request_id)
        if not held:
            return
        items = request.mm_items
        for index in [i for i in held if items[i].end <= request.num_computed_tokens]:
            self.used -= held.pop(index)
            self._to_free.append((request.request_id, index))
        if not held:
            del self._held[request.request_id]

    def free_all_passed(self, requests: dict[str, Request]) -> None:
        for req_id in list(self._held):
            request = requests.get(req_id)
            if request is not None:
                self.free_passed(request)

    def free(self, request: Request) -> None:
        """Drop everything of a request (finished, preempted or rolled back); the runner drops its
        entries with the request's state."""
        for n in self._held.pop(request.request_id, {}).values():
            self.used -= n

    def take_freed(self) -> list[tuple[str, int]]:
        freed, self._to_free = self._to_free, []
        return freed
