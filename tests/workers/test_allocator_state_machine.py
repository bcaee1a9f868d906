"""The hybrid SWA allocator as a state machine (hypothesis): random extend (one row, or a batch
of rows at once as a decode step or a verify does) / truncate / release_window / free / prefix
sharing against a simple model of the pages each request holds.
After every step: no full page is held by two requests unless it is a shared prefix page, the
pools' free counts equal the model's, every page a request still holds in the window maps to its
own SWA page, every page it let go maps to padding; at the end nothing leaks."""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from workers.memory import HybridSWAAllocator, OutOfKVError, ReqToTokenPool

P, WINDOW, FULL, SWA, ROWS = 4, 6, 24, 14, 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class AllocatorMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.r2t = ReqToTokenPool(ROWS, 64, "cpu")
        self.alloc = HybridSWAAllocator(self.r2t, FULL, SWA, P, WINDOW)
        self.rows: dict[int, dict] = {}  # row -> {"len": allocated positions, "gone": pages whose SWA page was let go}
        self.cached: list[int] = []  # full pages held by a stand-in for the prefix cache

    # -- model ------------------------------------------------------------------------------------
    def _pages(self, row: int) -> list[int]:
        return [int(self.r2t.host[row, i * P]) // P for i in range(cdiv(self.rows[row]["len"], P))]

    # -- rules ------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.rows) < ROWS)
    @rule(n=st.integers(1, 20), share=st.booleans())
    def new_request(self, n: int, share: bool) -> None:
        row = self.r2t.alloc()
        self.rows[row] = {"len": 0, "gone": 0, "floor": 0, "prefix": []}
        if share and self.cached:
            self.alloc.share_prefix(row, list(self.cached), swa_from=len(self.cached))  # window outside it
            n_shared = len(self.cached) * P
            self.rows[row] = {"len": n_shared, "gone": len(self.cached), "floor": n_shared, "prefix": list(self.cached)}
        self._extend(row, n)

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), n=st.integers(1, 9))
    def extend(self, data, n: int) -> None:
        self._extend(data.draw(st.sampled_from(sorted(self.rows))), n)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def extend_a_batch(self, data) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, unique=True))
        ends = [self.rows[r]["len"] + data.draw(st.integers(0, 6)) for r in rows]
        before = (self.alloc.full.num_free, self.alloc.swa.num_free)
        try:
            self.alloc.extend_rows(rows, ends)
        except OutOfKVError:
            assert (self.alloc.full.num_free, self.alloc.swa.num_free) == before  # all or nothing
            return
        for row, end in zip(rows, ends):
            self.rows[row]["len"] = end

    def _extend(self, row: int, n: int) -> None:
        before = (self.alloc.full.num_free, self.alloc.swa.num_free)
        try:
            self.alloc.extend(row, n)
        except OutOfKVError:
            assert (self.alloc.full.num_free, self.alloc.swa.num_free) == before  # nothing taken
            return
        self.rows[row]["len"] += n

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        row = data.draw(st.sampled_from(sorted(self.rows)))
        keep = data.draw(st.integers(self.rows[row]["floor"], self.rows[row]["len"]))  # never into a shared page
        self.alloc.truncate(row, keep)
        self.rows[row]["len"] = keep
        self.rows[row]["gone"] = min(self.rows[row]["gone"], cdiv(keep, P))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def release_window(self, data) -> None:
        row = data.draw(st.sampled_from(sorted(self.rows)))
        seq_len = data.draw(st.integers(0, self.rows[row]["len"]))
        self.alloc.release_window(row, seq_len)
        upto = max(0, seq_len // P * P - WINDOW + 1) // P
        self.rows[row]["gone"] = max(self.rows[row]["gone"], upto)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def finish(self, data) -> None:
        row = data.draw(st.sampled_from(sorted(self.rows)))
        self.alloc.free(row)
        self.r2t.free(row)
        del self.rows[row]

    @precondition(lambda self: self.rows and not self.cached)
    @rule(data=st.data())
    def cache_a_prefix(self, data) -> None:
        """The cache takes a hold on a request's first complete full pages."""
        row = data.draw(st.sampled_from(sorted(self.rows)))
        pages = self._pages(row)[: self.rows[row]["len"] // P]
        self.alloc.full.ref(pages)
        self.cached = pages

    @precondition(lambda self: self.cached)
    @rule()
    def drop_the_prefix(self) -> None:
        self.alloc.full.free(self.cached)
        self.cached = []

    # -- invariants -----------------------------------------------------------------------------------
    @invariant()
    def every_position_has_the_next_slot_of_its_page(self) -> None:
        for row, state in self.rows.items():
            n = state["len"]
            assert self.alloc.allocated_len(row) == n
            starts = self.r2t.host[row, :n:P].repeat(P)[:n]
            assert (self.r2t.host[row, :n] == starts + np.arange(n) % P).all(), row
            assert (starts % P == 0).all()

    @invariant()
    def pages_are_held_as_the_model_says(self) -> None:
        holders: dict[int, int] = {}
        swa_held = 0
        for row, state in self.rows.items():
            pages = self._pages(row)
            for i, page in enumerate(pages):
                holders[page] = holders.get(page, 0) + 1
                swa = int(self.alloc.full_to_swa[page * P]) // P
                if i >= state["gone"]:
                    assert swa > 0, f"row {row} page {i} lost its SWA page"
                    swa_held += 1
            assert len(set(pages)) == len(pages)
        for page in self.cached:
            holders[page] = holders.get(page, 0) + 1
        shared = set(self.cached).union(*(state["prefix"] for state in self.rows.values()))
        assert all(n == 1 or page in shared for page, n in holders.items()), holders
        assert all(self.alloc.full.holders(page) == n for page, n in holders.items())
        assert self.alloc.full.num_free == FULL - len(holders)
        mapped = [int(self.alloc.full_to_swa[pg * P]) // P for pg in range(1, FULL + 1)]
        assert len([s for s in mapped if s]) == SWA - self.alloc.swa.num_free  # SWA pages in use = mapped ones
        assert len({s for s in mapped if s}) == SWA - self.alloc.swa.num_free  # each mapped once
        assert swa_held == SWA - self.alloc.swa.num_free

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        for row in list(self.rows):
            self.alloc.free(row)
        if self.cached:
            self.alloc.full.free(self.cached)
        self.alloc.check_no_leak()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=1000, stateful_step_count=40, deadline=None)
