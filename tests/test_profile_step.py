"""profile_step's reading of overlapping kernels: what each adds to the device's busy time."""

from ops.bench.profile_step import added_us


def test_an_early_launched_kernel_adds_only_what_runs_past_the_one_before():
    # a 10 us kernel; the next starts (and waits) at 2 and ends at 13; one inside both; a gap, then one alone
    intervals = [(0.0, 10.0), (2.0, 13.0), (3.0, 5.0), (20.0, 24.0)]
    assert added_us(intervals) == [10.0, 3.0, 0.0, 4.0]
    assert sum(added_us(intervals)) == 17.0  # the union: [0, 13) and [20, 24)


def test_nothing_before_nothing_added():
    assert added_us([]) == []
