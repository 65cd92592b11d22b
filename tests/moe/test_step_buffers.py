"""The reused step buffers: host views write where uploads read, every asked prefix moves in one
copy, and block tables follow the runner's on the device, gathered per step by row."""
import numpy as np
import pytest
import torch

from moe.worker.step_buffers import StepBuffers


def test_upload_moves_every_asked_prefix_in_one_copy(monkeypatch):
    buf = StepBuffers(torch.device("cpu"), max_tokens=8, max_seqs=4, max_blocks=3, num_groups=2)
    assert buf.fits(8, 4, 3) and not buf.fits(9, 4, 3) and not buf.fits(8, 5, 3) and not buf.fits(8, 4, 4)
    buf.begin()
    buf.host_view("seq_lens", 2)[:] = [3, 4]
    buf.host_view("input_ids", 5)[:] = np.arange(10, 15)
    buf.host_view("slots0", 8)[:] = 77
    buf.host_view("slots1", 8)[:] = [7, -1, 9, 5, 5, 5, 5, 5]  # past the 3 asked: not moved
    copies = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, **kw: copies.append(1) or copy(self, src, **kw))
    buf.upload({"seq_lens": 2, "input_ids": 5, "slots1": 3})
    assert len(copies) == 1
    assert buf.dev_view("seq_lens", 2).tolist() == [3, 4]
    assert buf.dev_view("input_ids", 5).tolist() == [10, 11, 12, 13, 14]
    assert buf.dev_view("slots1", 8).tolist() == [7, -1, 9, 0, 0, 0, 0, 0]
    # inputs do not overlap
    assert buf.dev_view("slots0", 8).tolist() == [77] * 8  # inside the span: moved as it stands
    assert buf.dev_view("positions", 8).tolist() == [0] * 8


def test_pending_rows_go_up_with_the_inputs():
    """Async scheduling: each pending input id's runner row lands in pending_src (-1 elsewhere and in
    the padding), the sampling sequences' runner rows in sample_rows; a request whose pending token
    the in-flight step does not sample is refused by name."""
    from moe.worker.step_inputs import upload
    buf = StepBuffers(torch.device("cpu"), max_tokens=16, max_seqs=6, max_blocks=4, num_groups=1)
    batch = _batch([(3, 1), (0, 5), (6, 1)])
    batch.rows_B = np.array([7, 2, 5])
    batch.pending_src_T = np.array([7, -1, -1, -1, -1, -1, 5])
    batch.check_pending(np.array([5, 9, 7]))
    upload(buf, batch, 4, padded=(9, 5))
    assert buf.dev_view("pending_src", 9).tolist() == [7, -1, -1, -1, -1, -1, 5, -1, -1]
    assert buf.dev_view("sample_rows", 3).tolist() == [7, 2, 5]
    with pytest.raises(RuntimeError, match=r"\['r2'\] wait for tokens"):
        batch.check_pending(np.array([7, 2]))
    with pytest.raises(RuntimeError, match="none was given"):
        batch.check_pending(None)


def test_device_tables_follow_the_runner_tables():
    """The device copy of the runner's block tables gets only the blocks added since the last upload
    (a freed row taken by a new request: its new blocks win), and each step gathers its sequences'
    rows by table_rows, as a CUDA graph's capture of gather_tables does at replay."""
    from moe.worker.block_tables import BlockTables
    from moe.worker.step_inputs import upload
    tables = BlockTables(num_groups=2, rows=4, cols=2, log_writes=True)
    buf = StepBuffers(torch.device("cpu"), max_tokens=16, max_seqs=4, max_blocks=6, num_groups=2, runner_rows=8)
    a, b, c = tables.add([[5, 6], [1]]), tables.add([[7], [2]]), tables.add([[9, 10, 11], [3, 4]])
    batch = _built_batch(tables, [c, a])
    upload(buf, batch, 4)
    assert buf.tables[0][:2, :3].tolist() == [[9, 10, 11], [5, 6, 0]]
    assert buf.tables[1][:2, :2].tolist() == [[3, 4], [1, 0]]
    staged = []
    stage = buf.stage_table_writes
    buf.stage_table_writes = lambda writes, *args: staged.append(len(writes)) or stage(writes, *args)
    tables.extend(a, 0, [12])
    tables.remove(b)
    d = tables.add([[20, 21], [22]])  # b's row again, other blocks
    tables.remove(d)
    e = tables.add([[30], [31]])  # and once more before any upload: the last write wins
    assert e == b
    upload(buf, _built_batch(tables, [a, e, c]), 4, padded=(4, 4), metadata=False)
    assert staged == [5]  # a's new block, then d's and e's in each group: the writes since the last upload
    assert buf.tables[0][:2, :3].tolist() == [[9, 10, 11], [5, 6, 0]]  # a graph's replay gathers them
    buf.gather_tables(4)
    got = [buf.tables[g][:3].tolist() for g in range(2)]
    assert [r[:3] for r in got[0]] == [[5, 6, 12], [30, 21, 0], [9, 10, 11]]
    assert [r[:2] for r in got[1]] == [[1, 0], [31, 0], [3, 4]]
    assert buf.dev_view("table_rows", 4).tolist()[3] == 0  # a padding sequence: any row, never read
    assert buf.runner_rows == 8
    buf.grow_rows(20)  # more runner rows: what the device holds is kept
    assert buf.runner_rows == 20 and buf.row_tables[0, 4 + a, :3].tolist() == [5, 6, 12]


def test_many_table_writes_go_up_apart():
    """More writes than the span holds (a prompt of many blocks) go up on their own, to the same tables."""
    from moe.worker.block_tables import BlockTables
    from moe.worker.step_inputs import upload
    tables = BlockTables(num_groups=1, rows=4, cols=4, log_writes=True)
    buf = StepBuffers(torch.device("cpu"), max_tokens=64, max_seqs=4, max_blocks=20, num_groups=1,
                      runner_rows=4, max_table_writes=8)
    a, b = tables.add([list(range(100, 115))]), tables.add([[7, 8]])
    upload(buf, _built_batch(tables, [b, a]), 4)
    assert buf.tables[0][0, :2].tolist() == [7, 8] and buf.tables[0][1, :15].tolist() == list(range(100, 115))
    tables.extend(b, 0, [9])
    upload(buf, _built_batch(tables, [b]), 4)
    assert buf.tables[0][0, :3].tolist() == [7, 8, 9]


def test_a_synthetic_batch_takes_scratch_rows():
    """A batch with tables of its own (warm-up, the dummy step) writes them to scratch rows, not
    over any request's."""
    from moe.worker.block_tables import BlockTables
    from moe.worker.step_inputs import StepBatch, upload
    tables = BlockTables(num_groups=1, rows=4, cols=4, log_writes=True)
    buf = StepBuffers(torch.device("cpu"), max_tokens=8, max_seqs=3, max_blocks=4, num_groups=1, runner_rows=4)
    a = tables.add([[5, 6]])
    upload(buf, _built_batch(tables, [a]), 4)
    upload(buf, StepBatch.one_token([42]), 4)
    assert buf.tables[0][0, 0].item() == 42 and buf.row_tables[0, 3 + a, :2].tolist() == [5, 6]
    upload(buf, _built_batch(tables, [a]), 4)
    assert buf.tables[0][0, :2].tolist() == [5, 6]


def _built_batch(tables, rows, block_size=4):
    """A decode step of the given runner rows, each at the end of its shortest group's blocks."""
    from moe.worker.step_inputs import StepBatch
    rows = np.asarray(rows)
    seq_lens = np.min([lens[rows] for lens in tables.lens], axis=0) * block_size
    B = len(rows)
    return StepBatch([f"r{r}" for r in rows], [], np.ones(B, dtype=np.int64), np.arange(B + 1), seq_lens,
                     np.zeros(B, dtype=np.int64), seq_lens - 1, np.arange(B), None, list(range(B)), rows_B=rows,
                     source=tables)


def _batch(seqs, block_size=4):
    """A StepBatch of (cached, new) sequences whose blocks are numbered in order."""
    from moe.worker.step_inputs import StepBatch
    n = np.array([k for _, k in seqs])
    qsl = np.concatenate([[0], np.cumsum(n)])
    seq_lens = np.array([c + k for c, k in seqs])
    row = np.repeat(np.arange(len(seqs)), n)
    positions = np.arange(qsl[-1]) - qsl[:-1][row] + (seq_lens - n)[row]
    width = max(-(-L // block_size) for L in seq_lens)
    table = np.arange(len(seqs) * width).reshape(len(seqs), width) + 1
    return StepBatch([f"r{i}" for i in range(len(seqs))], [], n, qsl, seq_lens, positions + 100, positions, row,
                     [table], list(range(len(seqs))), rows_B=np.arange(len(seqs)))


def test_mixed_graph_padding_layout():
    """A mixed step padded to a graph of t tokens and b sequences: the padding tokens form
    sequences of context 0 after the real ones, with slot -1 and position 0."""
    from moe.worker.step_inputs import upload
    buf = StepBuffers(torch.device("cpu"), max_tokens=16, max_seqs=6, max_blocks=4, num_groups=1)
    batch = _batch([(3, 1), (0, 5), (6, 1)])  # T = 7, B = 3
    meta = upload(buf, batch, 4, padded=(10, 6))
    assert meta.query_start_loc_t.tolist() == [0, 1, 6, 7, 8, 9, 10]  # three padding tokens, one each
    assert meta.seq_lens_t.tolist() == [4, 5, 7, 0, 0, 0]
    assert buf.dev_view("slots0", 10).tolist()[7:] == [-1] * 3
    assert buf.dev_view("positions", 10).tolist() == batch.positions_T.tolist() + [0] * 3
    assert meta.block_tables_BM.shape == (6, 4) and not meta.decode_only
    # The graph's LM head reads min(t, b) sample rows: the real ones, then token 0.
    assert buf.dev_view("sample_idx", 6).tolist() == [0, 5, 6, 0, 0, 0]
    # More padding tokens than spare sequences: the last one holds the rest.
    meta = upload(buf, batch, 4, padded=(16, 5))
    assert meta.query_start_loc_t.tolist() == [0, 1, 6, 7, 8, 16]
    upload(buf, _batch([(0, 9), (2, 1)]), 4, padded=(16, 5))  # a later step's rows replace the earlier's
    assert buf.dev_view("sample_idx", 5).tolist() == [8, 9, 0, 0, 0]
    # No padding token: the spare sequences are empty.
    meta = upload(buf, batch, 4, padded=(7, 6))
    assert meta.query_start_loc_t.tolist() == [0, 1, 6, 7, 7, 7, 7]


def test_decode_graph_padding_layout():
    from moe.worker.step_inputs import upload
    buf = StepBuffers(torch.device("cpu"), max_tokens=8, max_seqs=8, max_blocks=4, num_groups=1)
    meta = upload(buf, _batch([(3, 1), (7, 1)]), 4, padded=(4, 4))
    assert meta.query_start_loc_t.tolist() == [0, 1, 2, 3, 4] and meta.seq_lens_t.tolist() == [4, 8, 0, 0]
    assert meta.decode_only and buf.dev_view("sample_idx", 4).tolist() == [0, 1, 0, 0]


def test_padding_that_cannot_hold_the_step_is_refused():
    import pytest

    from moe.worker.step_inputs import upload
    buf = StepBuffers(torch.device("cpu"), max_tokens=16, max_seqs=6, max_blocks=4, num_groups=1)
    batch = _batch([(3, 1), (0, 5)])
    for padded in [(5, 4), (6, 1), (9, 2)]:  # fewer tokens, fewer sequences, padding tokens but no sequence
        with pytest.raises(ValueError, match="cannot pad"):
            upload(buf, batch, 4, padded=padded)
