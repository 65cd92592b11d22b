"""The messages between API processes and engine cores, as msgpack (never pickle).

Every message is one msgpack array whose first item names it:

    client -> core   ["hello"]                          register; the core answers "ready"
                     ["add", [request, ...]]            request = [id, prompt ids, max_tokens, eos ids, params,
                                                        images]
                     ["abort", [id, ...]]               finish sequences as aborted (blocks freed)
                     ["stop", [id, ...]]                finish sequences a stop string ended
                     ["control", op, [arg, ...]]        sleep mode: "sleep" [level], "wake_up", "is_sleeping";
                                                        answered ["control", {"sleeping": level, "error": null
                                                        or why}], in order
    core -> client   ["ready", {"pid", "num_blocks"}]
                     ["step", outputs, stats, queue_times, errors, expert_load_windows]
                                                        the client's sequences of one step (and the
                                                        expert-load windows closed after it, to all)
                     ["stats", stats]                   the scheduler's state, sent when idle
                     ["dead", error]                    the core failed and is exiting

params is SamplingParams' fields as a map (structured_outputs: null or StructuredOutputsParams' fields
as a map); images is one [hash, offset, length, num_embeds,
pixels] per image of the prompt, pixels = [dtype name, shape, raw bytes], null when the core's side
of the IPC cache holds that image (mm_processor_cache_type "lru"), or {"shm": [store, handle]} in a
shared-memory store ("shm"); an output is [id, new
token ids, logprobs, finish_reason, stop_reason, num_cached_tokens, prompt logprobs,
stopped_by_grammar, routed experts] with logprobs null or one [token, logprob, rank, top ids, top logprobs] per new
token, and prompt logprobs null or [start, logprobs, ranks, top ids, top logprobs]
(moe/worker/prompt_logprobs.py's PromptLogprobs), routed experts null or [start position, shape,
int16 little-endian bytes] (moe/engine/routed_experts.py); stats is SchedulerStats' fields in order.
"""
from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import torch

from moe.engine.core import CoreRequest, CoreStepResult, SchedulerStats
from moe.multimodal.inputs import ImageItem
from moe.multimodal.processor_cache import ReceiverCache, SenderCache
from moe.multimodal.shm_transport import ShmPixels, ShmSender
from moe.sampling_params import SamplingParams
from moe.structured_output.params import StructuredOutputsParams
from moe.worker.model_runner import TokenLogprobs
from moe.worker.prompt_logprobs import PromptLogprobs
from scheduler.output import EngineCoreOutput

_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
_STATS_FIELDS = [f.name for f in dataclasses.fields(SchedulerStats)]


def _default(obj):
    """Numbers that are not Python's own (numpy / torch scalars) travel as Python numbers."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (tuple, set)):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in a message")


def encode(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True, default=_default)


def decode(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---- requests ----------------------------------------------------------------------------
def pack_tensor(t: torch.Tensor) -> list:
    """[dtype name, shape, raw bytes]: bf16 travels as its 16-bit patterns."""
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return [str(t.dtype).removeprefix("torch."), list(t.shape), raw.numpy().tobytes()]


def unpack_tensor(item: list) -> torch.Tensor:
    dtype_name, shape, data = item
    dtype = getattr(torch, dtype_name)
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy()).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(np.frombuffer(data, dtype=torch.empty(0, dtype=dtype).numpy().dtype).copy()).reshape(shape)


def pack_params(p: SamplingParams) -> dict:
    """SamplingParams' fields as a map; the nested StructuredOutputsParams as a map of its own."""
    packed = {name: getattr(p, name) for name in _PARAM_FIELDS}
    if p.structured_outputs is not None:
        packed["structured_outputs"] = dataclasses.asdict(p.structured_outputs)
    return packed


def unpack_params(packed: dict) -> SamplingParams:
    so = packed.get("structured_outputs")
    if so is not None:
        packed = {**packed, "structured_outputs": StructuredOutputsParams(**so)}
    return SamplingParams(**packed)


def pack_request(req: CoreRequest, ipc: SenderCache | None = None, shm: ShmSender | None = None) -> list:
    """ipc: the API side of the IPC cache; an image the engine core holds already travels as its
    hash alone (pixels null). shm: the shared-memory store the pixels go through ({"shm": [store,
    handle]}) when it takes them."""
    p = req.params
    images = []
    for m in req.mm_items:
        placed = shm.place(m.mm_hash, m.pixel_values) if shm is not None else None
        if placed is not None:
            packed = {"shm": placed}
        else:
            pixels = m.pixel_values if ipc is None else ipc.prepare(
                m.mm_hash, m.pixel_values, (tuple(m.pixel_values.shape), m.pixel_values.dtype, m.layout))
            packed = None if pixels is None else pack_tensor(pixels)
        images.append([m.mm_hash, m.offset, m.length, m.num_embeds, packed])
    return [req.request_id, req.prompt_token_ids, req.max_tokens, list(req.eos_token_ids),
            pack_params(p), images]


def unpack_request(item: list, ipc: ReceiverCache | None = None) -> CoreRequest:
    """ipc: the engine-core side of the sender's IPC cache (resolves the images sent as hashes)."""
    request_id, prompt_token_ids, max_tokens, eos, params, images = item
    items = []
    for h, offset, length, n, pixels in images:
        if isinstance(pixels, dict):
            pixels = ShmPixels(*pixels["shm"])
        else:
            pixels = None if pixels is None else unpack_tensor(pixels)
            pixels = pixels if ipc is None else ipc.resolve(h, pixels)
        items.append(ImageItem(h, offset, length, n, pixels))
    return CoreRequest(request_id, prompt_token_ids, max_tokens, unpack_params(params), tuple(eos), items)


# ---- step results ------------------------------------------------------------------------
def pack_stats(s: SchedulerStats) -> list:
    return [getattr(s, name) for name in _STATS_FIELDS]


def unpack_stats(item: list) -> SchedulerStats:
    return SchedulerStats(*item)


def pack_output(co: EngineCoreOutput) -> list:
    lps = None if co.new_logprobs is None else [
        [e.token_id, e.logprob, e.rank, e.top_ids, e.top_logprobs] for e in co.new_logprobs]
    plp = co.prompt_logprobs
    plp = None if plp is None else [plp.start, plp.logprobs, plp.ranks, plp.top_ids, plp.top_logprobs]
    routed = None if co.routed_experts is None else [co.routed_experts_start, list(co.routed_experts.shape),
                                                     co.routed_experts.astype("<i2").tobytes()]
    return [co.req_id, co.new_token_ids, lps, co.finish_reason, co.stop_reason, co.num_cached_tokens, plp,
            co.stopped_by_grammar, routed]


def unpack_output(item: list) -> EngineCoreOutput:
    req_id, tokens, lps, finish_reason, stop_reason, num_cached, plp, by_grammar, routed = item
    if lps is not None:
        lps = [TokenLogprobs(*e) for e in lps]
    co = EngineCoreOutput(req_id, tokens, lps, finish_reason, stop_reason, num_cached,
                          None if plp is None else PromptLogprobs(*plp), by_grammar)
    if routed is not None:
        start, shape, data = routed
        co.routed_experts_start, co.routed_experts = start, np.frombuffer(data, dtype="<i2").reshape(shape)
    return co


def pack_step(result: CoreStepResult) -> bytes:
    """A step's result (the part of it for one client)."""
    return encode(["step", [pack_output(co) for co in result.outputs], pack_stats(result.stats),
                   result.queue_times, result.errors, result.expert_load_windows])


def unpack_step(message: list) -> CoreStepResult:
    _, outputs, stats, queue_times, errors, windows = message
    return CoreStepResult([unpack_output(o) for o in outputs], unpack_stats(stats), queue_times, errors, windows)
