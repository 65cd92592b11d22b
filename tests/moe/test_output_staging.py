"""The sampled outputs' pinned staging (CUDA): a buffer serves one step at a time and comes back
once its step has been read; a step read twice gives the same lists and its buffers back once."""
import numpy as np
import pytest
import torch

from moe.worker.model_runner import PendingStep
from moe.worker.output_staging import PinnedStaging
from moe.worker.sampler import SamplerOutput

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging serves CUDA steps")


def test_a_buffer_serves_one_step_at_a_time():
    staging = PinnedStaging()
    first, raw1 = staging.copy_of(torch.arange(256, device="cuda"))
    second, raw2 = staging.copy_of(torch.arange(256, device="cuda") + 1000)  # in flight beside the first
    assert raw1.data_ptr() != raw2.data_ptr()
    event = staging.event()
    event.record()
    event.synchronize()
    assert first.tolist() == list(range(256)) and second.tolist() == list(range(1000, 1256))
    staging.give_back([raw1], event)
    third, raw3 = staging.copy_of(torch.arange(200, device="cuda"))  # 1,600 bytes: the 2,048-byte class
    assert raw3.data_ptr() == raw1.data_ptr() and staging.event() is event
    fourth, raw4 = staging.copy_of(torch.zeros(3, dtype=torch.float32, device="cuda"))  # another class
    assert raw4.data_ptr() not in (raw1.data_ptr(), raw2.data_ptr())
    torch.cuda.synchronize()
    assert third.tolist() == list(range(200)) and fourth.tolist() == [0.0] * 3


class _Batch:
    req_ids, sample_rows = ["a", "b"], [0, 1]

    @staticmethod
    def sample_rows_R():
        return np.arange(2)


def test_a_step_read_twice_gives_its_buffers_back_once():
    staging = PinnedStaging()
    step = PendingStep(_Batch(), SamplerOutput(torch.tensor([7, 9], device="cuda")), staging=staging)
    assert step.lists() == {"sampled": [7, 9]}
    assert step.lists() == {"sampled": [7, 9]}
    assert sum(len(free) for free in staging._buffers.values()) == 1 and len(staging._events) == 1
    # the next step reuses them and reads its own values
    later = PendingStep(_Batch(), SamplerOutput(torch.tensor([1, 2], device="cuda")), staging=staging)
    assert later.lists() == {"sampled": [1, 2]} and step.lists() == {"sampled": [7, 9]}
