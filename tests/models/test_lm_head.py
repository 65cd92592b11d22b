"""The LM head's logits into a given buffer (what the CUDA graphs write at every replay): the same
values as its own output, also in batch-invariant mode; a buffer of the wrong shape, or one under
tensor parallelism (the logits are gathered over ranks), is refused."""
import pytest
import torch

from kernels import batch_invariant
from models.layers.embedding import ParallelLMHead
from models.parallel.state import ParallelState, get_parallel_state, set_parallel_state


def _head(vocab: int = 40, hidden: int = 16) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0)))
    return head


@pytest.mark.parametrize("invariant", [False, True])
def test_logits_into_a_buffer_are_the_head_s_own(invariant):
    head = _head()
    hidden = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    previous = batch_invariant.set_enabled(invariant)
    try:
        want = head.compute_logits(hidden)
        buffer = torch.full((8, 40), float("nan"))
        got = head.compute_logits(hidden, out=buffer[:5])
    finally:
        batch_invariant.set_enabled(previous)
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:5], want) and buffer[5:].isnan().all()


def test_a_buffer_of_the_wrong_shape_is_refused():
    head = _head()
    with pytest.raises(ValueError, match=r"\[3, 40\] buffer"):
        head.compute_logits(torch.zeros(3, 16), out=torch.empty(3, 39))


def test_a_buffer_under_tensor_parallelism_is_refused():
    saved = get_parallel_state()
    set_parallel_state(ParallelState(tp_size=2, tp_rank=0))
    try:
        head = _head()
    finally:
        set_parallel_state(saved)
    with pytest.raises(ValueError, match="tensor-parallel size 2"):
        head.compute_logits(torch.zeros(3, 16), out=torch.empty(3, 20))
