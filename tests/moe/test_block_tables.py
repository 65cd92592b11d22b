"""The runner's persistent block tables: rows reused, rows and columns grown on demand, and a
gather that returns exactly each request's blocks (in row order, padded to the longest)."""
import numpy as np

from moe.worker.block_tables import BlockTables


def test_add_extend_gather_and_reuse():
    t = BlockTables(num_groups=2, rows=2, cols=2)
    a = t.add([[5, 6], [1]])
    b = t.add([[7], []])
    c = t.add([[9, 10, 11], [2, 3, 4]])  # a third row and a third column: both grow
    t.extend(b, 0, [8, 12, 13])
    got = t.gather(0, np.array([c, a, b]))
    assert got.shape == (3, 4)
    assert got[0, :3].tolist() == [9, 10, 11] and got[1, :2].tolist() == [5, 6] and got[2].tolist() == [7, 8, 12, 13]
    assert t.gather(1, np.array([a, c]))[:, :1].tolist() == [[1], [2]]
    assert t.gather(1, np.array([c])).tolist() == [[2, 3, 4]]
    t.remove(a)
    d = t.add([[42], [43]])
    assert d == a  # the freed row is reused, and its old blocks are gone
    assert t.gather(0, np.array([d])).tolist() == [[42]] and t.gather(1, np.array([d])).tolist() == [[43]]


def test_many_rows():
    t = BlockTables(num_groups=1, rows=1, cols=1)
    rows = [t.add([[i, i + 1000]]) for i in range(100)]
    assert len(set(rows)) == 100
    assert t.gather(0, np.array(rows)).tolist() == [[i, i + 1000] for i in range(100)]


def test_writes_are_logged_for_the_device_copy():
    """With log_writes every add and extend is logged once, in order, and take_writes empties the log;
    without it nothing is kept (a CPU runner never takes them)."""
    import pytest
    t = BlockTables(num_groups=2, rows=2, cols=2, log_writes=True)
    a = t.add([[5, 6], []])
    t.extend(a, 1, [9])
    t.extend(a, 0, [])
    assert t.take_writes() == [(0, a, 0, [5, 6]), (1, a, 0, [9])]
    t.extend(a, 0, [7])
    assert t.take_writes() == [(0, a, 2, [7])] and t.take_writes() == []
    quiet = BlockTables(num_groups=1)
    quiet.add([[1]])
    with pytest.raises(RuntimeError, match="no log"):
        quiet.take_writes()
