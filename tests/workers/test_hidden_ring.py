"""The hidden ring's row accounting (`workers/hidden_ring.py`): what a release frees, where a step
that would wrap starts, that a step never takes rows still unread (its padded rows included), and
where padded rows past the last go."""

import pytest
import torch

from workers.hidden_ring import HiddenRing


def _ring(capacity: int, slack: int = 1) -> HiddenRing:
    return HiddenRing(capacity, 4, torch.float32, torch.device("cpu"), slack=slack)


def test_a_release_frees_the_kept_steps_rows_and_not_those_of_the_step_in_flight():
    ring = _ring(10)
    kept, in_flight = ring.take(3), ring.take(3)
    assert (kept, in_flight, ring.free) == (0, 3, 4)
    ring.release(kept + 3)
    assert ring.free == 7  # the step in flight keeps its rows
    assert ring.take(3) == 6
    assert ring.take(3) == 10 and ring.row(10) == 0  # rows 9..11 would wrap: the step starts at row 0
    assert ring.free == 0
    with pytest.raises(RuntimeError, match="hidden ring: 1 rows for a step \\(up to 1 with padding\\), 0 of 10 free"):
        ring.take(1)
    ring.release(13)  # a catch-up read up to the latest step: every step before it is freed with it
    assert ring.free == 10 and ring.take(1) == 13


def test_a_release_frees_the_steps_taken_before_those_read_whose_forwards_failed():
    ring = _ring(8)
    ring.take(2)  # a step whose forward failed: never kept
    second = ring.take(2)
    ring.release(second + 2)
    assert ring.free == 8


def test_a_step_takes_rows_only_where_its_padded_rows_are_free_too():
    """A graph pads a batch of 1 to up to 4 rows, which it writes as well (the next step's rows,
    written again by that step's own replay): they must not reach rows still unread. Padded rows
    past the last row go to the slack rows, which nothing reads."""
    ring = _ring(10, slack=4)
    assert ring.scratch == 10 and ring.buffer.shape == (14, 4)
    ring.release(ring.take(5) + 5)  # rows 0..4 read and freed; the next step starts at row 5
    ring.take(4)  # rows 5..8, unread until the next catch-up
    assert ring.take(1) == 9  # its padded rows: the slack
    assert [ring.row(ring.take(1)) for _ in range(2)] == [0, 1]  # padded rows 0..3 and 1..4: free
    with pytest.raises(RuntimeError, match="1 rows for a step \\(up to 4 with padding\\), 3 of 10 free"):
        ring.take(1)  # rows 2..4 are free, but its padded rows would reach row 5
    ring.release(12)  # up to the last step taken: every step before it is freed with it
    assert ring.row(ring.take(1)) == 2


def test_the_ring_takes_the_dtype_and_width_of_the_rows_written_before_any_is_kept():
    ring = _ring(4)
    ring.match(torch.zeros(2, 6, dtype=torch.bfloat16))
    assert ring.buffer.shape == (5, 6) and ring.buffer.dtype == torch.bfloat16
    ring.take(2)
    with pytest.raises(RuntimeError, match="after rows were taken"):
        ring.match(torch.zeros(2, 6))
