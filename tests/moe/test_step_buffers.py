"""The reused step buffers: host views write where uploads read, only the asked prefix moves,
and block tables land in the corner of their [max_seqs, max_blocks] tensor."""
import numpy as np
import torch

from moe.worker.step_buffers import StepBuffers


def test_upload_moves_the_prefix_of_each_input():
    buf = StepBuffers(torch.device("cpu"), max_tokens=8, max_seqs=4, max_blocks=3, num_groups=2)
    assert buf.fits(8, 4, 3) and not buf.fits(9, 4, 3) and not buf.fits(8, 5, 3) and not buf.fits(8, 4, 4)
    buf.begin()
    buf.host_view("input_ids", 5)[:] = np.arange(10, 15)
    buf.host_view("slots1", 3)[:] = [7, -1, 9]
    buf.host_view("positions", 8)[:] = 99  # written but not uploaded
    buf.upload({"input_ids": 5, "slots1": 3})
    assert buf.dev_view("input_ids", 5).tolist() == [10, 11, 12, 13, 14]
    assert buf.dev_view("slots1", 3).tolist() == [7, -1, 9]
    assert buf.dev_view("positions", 8).tolist() == [0] * 8
    assert buf.dev_view("slots0", 8).tolist() == [0] * 8  # inputs do not overlap


def test_tables_go_to_the_corner():
    buf = StepBuffers(torch.device("cpu"), max_tokens=4, max_seqs=3, max_blocks=4, num_groups=1)
    buf.upload_tables(0, np.array([[5, 6], [7, 8]], dtype=np.int64))
    assert buf.tables[0].tolist() == [[5, 6, 0, 0], [7, 8, 0, 0], [0, 0, 0, 0]]
