"""The hidden ring's row accounting (`workers/hidden_ring.py`): what a release frees, where a step
that would wrap starts, and that a step never takes rows still unread."""

import pytest
import torch

from workers.hidden_ring import HiddenRing


def _ring(capacity: int) -> HiddenRing:
    return HiddenRing(capacity, 4, torch.float32, torch.device("cpu"))


def test_a_release_frees_the_kept_steps_rows_and_not_those_of_the_step_in_flight():
    ring = _ring(10)
    kept, in_flight = ring.take(3), ring.take(3)
    assert (kept, in_flight, ring.free) == (0, 3, 4)
    assert ring.keep(ring.buffer[kept : kept + 3])  # a graph wrote it: a view of the ring
    ring.release()
    assert ring.free == 7  # the step in flight keeps its rows
    assert ring.take(3) == 6
    assert ring.take(3) == 0  # rows 9..11 would wrap: the step starts at row 0 (the kept step's, freed)
    assert ring.free == 0
    with pytest.raises(RuntimeError, match="hidden ring: 1 rows for a step, 0 of 10 free"):
        ring.take(1)
    assert not ring.keep(torch.zeros(3, 4))  # an eager forward's own tensor holds the oldest step taken
    ring.release()
    assert ring.free == 3  # the two steps taken since hold rows 6..8 and 0..2; row 9 was skipped


def test_keeping_a_later_step_releases_the_steps_taken_before_it_that_were_never_kept():
    ring = _ring(8)
    ring.take(2)  # a step whose forward failed: never kept
    second = ring.take(2)
    assert ring.keep(ring.buffer[second : second + 2])
    ring.release()
    assert ring.free == 8


def test_padded_rows_write_the_row_past_the_last():
    ring = _ring(5)
    assert ring.scratch == 5 and ring.buffer.shape == (6, 4)


def test_the_ring_takes_the_dtype_and_width_of_the_rows_written_before_any_is_kept():
    ring = _ring(4)
    ring.match(torch.zeros(2, 6, dtype=torch.bfloat16))
    assert ring.buffer.shape == (5, 6) and ring.buffer.dtype == torch.bfloat16
    ring.take(2)
    with pytest.raises(RuntimeError, match="after rows were kept"):
        ring.match(torch.zeros(2, 6))
