"""The shared-memory object store against pickling, for real-size Llama-4 image inputs (CPU only).

Each image is {"pixel_values": bf16 [5, 3, 336, 336] (5 tiles, 3.4 MB), "aspect_ratio": [2, 2]}.
Times, per image (median over the images): the writer's put (serialise into the ring, evicting the
oldest finished objects) and handle_for hit, a reader's get (copy out) and get(copy=False) + release,
and pickle.dumps / pickle.loads of the same dict (what the IPC path ships without the store).
The reader is attached in this process: reading from another process costs the same memory copy.
The ring is filled once before timing (first-touch page faults of the segment are not timed).

    python -m benchmarks.mm_cache_bench [--images 24] [--tiles 5] [--capacity-mib 64] [--out result.json]
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

import torch

from moe.multimodal.shm_store import SharedMemoryObjectStore, ShmHandle


def _median_s(fn, items) -> float:
    times = []
    for item in items:
        t0 = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(seconds: float, nbytes: int) -> dict:
    return {"latency_ms": round(seconds * 1e3, 4), "GB_per_s": round(nbytes / seconds / 1e9, 3) if seconds else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--tiles", type=int, default=5)
    parser.add_argument("--capacity-mib", type=int, default=64)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    images = [{"pixel_values": torch.randn(args.tiles, 3, 336, 336, generator=g).to(torch.bfloat16),
               "aspect_ratio": [2, 2]} for _ in range(args.images)]
    nbytes = images[0]["pixel_values"].numel() * 2

    writer = SharedMemoryObjectStore(args.capacity_mib << 20, num_readers=1)
    reader = SharedMemoryObjectStore.attach(writer.name, 0)
    try:
        for i in range((args.capacity_mib << 20) // nbytes + 2):  # wrap the ring once: page faults not timed
            reader.release(writer.put(f"warm{i}", images[i % args.images]))
        handles = []

        def put(i):
            handle = writer.put(f"img{i}", images[i])
            assert isinstance(handle, ShmHandle), handle
            handles.append(handle)
            reader.release(handle)  # the reader is done at once: eviction always finds room

        put_s = _median_s(put, range(args.images))
        live = handles[-max(1, writer.num_objects // 2):]  # still stored (the ring evicted the oldest)
        hit_s = _median_s(lambda h: reader.release(writer.handle_for(h.key)), live)
        get_s = _median_s(lambda h: reader.get(writer.handle_for(h.key)), live)

        def get_view(h):
            h = writer.handle_for(h.key)
            obj = reader.get(h, copy=False)
            float(obj["pixel_values"][0, 0, 0, 0])  # touch it
            del obj
            reader.release(h)

        view_s = _median_s(get_view, live)
        pickled = [pickle.dumps(img, protocol=pickle.HIGHEST_PROTOCOL) for img in images]
        dumps_s = _median_s(lambda img: pickle.dumps(img, protocol=pickle.HIGHEST_PROTOCOL), images)
        loads_s = _median_s(pickle.loads, pickled)
        for img, data in zip(images[:2], pickled[:2]):
            assert torch.equal(pickle.loads(data)["pixel_values"], img["pixel_values"])
        assert torch.equal(reader.get(writer.handle_for(live[-1].key))["pixel_values"],
                           images[int(live[-1].key[3:])]["pixel_values"])
        result = {
            "pixel_values": {"shape": [args.tiles, 3, 336, 336], "dtype": "bfloat16", "bytes": nbytes},
            "capacity_mib": args.capacity_mib,
            "images": args.images,
            "shm": {
                "put": _row(put_s, nbytes),
                "hit_handle_for": _row(hit_s, 0) | {"GB_per_s": None},
                "get_copy": _row(get_s, nbytes),
                "get_view_and_release": _row(view_s, 0) | {"GB_per_s": None},
                "handle_pickled_bytes": len(pickle.dumps(handles[-1])),
                "evictions": writer.evictions,
            },
            "pickle": {
                "dumps": _row(dumps_s, nbytes),
                "loads": _row(loads_s, nbytes),
                "pickled_bytes": len(pickled[0]),
            },
        }
    finally:
        reader.close()
        writer.close()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
