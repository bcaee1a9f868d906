"""Adaptive draft length (`workers/speculative/controller.py`, docs/design.md §6.1): the controller
on synthetic cost and acceptance tables (it picks the fastest k, does not flap, tries what it has
not measured, probes deeper, changes between plain steps and rounds only where the change repays
what it measured it to cost, probes from plain steps within their share of the time), the cost
and acceptance models, and engines whose draft length switches between 0 and k on a forced
schedule: greedy output equals plain decoding for every algorithm on the shipped tiny models,
eager and under emulated graph replay, a draft that fell behind by plain decode steps catches up
exactly, lazily where its pool allows, and the controller is told which steps' times are their
kind's."""

import collections
import dataclasses
import itertools
import types

import numpy as np
import pytest
import torch

from attention import ForwardMode
from ops import DEFAULT_MODEL, DRAFT_MODELS
from tests.draft_models import SPEC_VARIANTS, make_perturbed_copy
from tests.hf_models import WINDOW, make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams
from workers.speculative import cost_model
from workers.speculative import worker as worker_module
from workers.speculative.acceptance import AcceptanceModel
from workers.speculative.controller import AdaptiveDraftSteps
from workers.speculative.cost_model import EXCURSION, MAX_DRIFT, SWITCH, CostModel

K = 3
BUCKETS = [1, 4, 16, 64]


class Schedule:
    """A controller forced through `ks` in turn, one decode step each."""

    def __init__(self, ks: list[int]) -> None:
        self._ks = itertools.cycle(ks)
        self.k = next(self._ks)

    def choose(self, batch_size, expected_tokens) -> int:
        return self.k

    def observe(self, batch_size, k, seconds, clean=True) -> None:
        assert k == self.k
        self.k = next(self._ks)


def _costs(rows: dict[int, list[float]]) -> CostModel:
    costs = CostModel(BUCKETS, K)
    for bucket, row in rows.items():
        for k, seconds in enumerate(row):
            costs.set_prior(bucket, k, seconds)
    return costs


def _tokens(batch: int, rate: float) -> np.ndarray:
    """A batch's expected tokens for k = 0..K when every position accepts at `rate`."""
    return batch * np.array([sum(rate**i for i in range(k + 1)) for k in range(K + 1)])


def _drive(ctrl: AdaptiveDraftSteps, batch: int, tokens, steps: int, seconds=None, change: float = 0.0) -> list[int]:
    """`steps` decode steps: choose, then observe (seconds(k): the step's time, default the
    model's own estimate; `change`: what a step of another k than the step before takes more)."""
    chosen = []
    for _ in range(steps):
        k = ctrl.choose(batch, lambda: tokens)
        assert ctrl.choose(batch, lambda: tokens) == k, "a second ask before the step changed the answer"
        took = seconds(k) if seconds is not None else ctrl.costs.seconds(batch)[k]
        ctrl.observe(batch, k, took + (change if chosen and k != chosen[-1] else 0.0))
        chosen.append(k)
    return chosen


# -- the models and the controller on synthetic tables ----------------------------------------------
def test_the_cost_model_buckets_and_takes_medians_of_measurements_over_its_priors():
    costs = _costs({4: [1.0, 2.0, 3.0, 4.0], 16: [2.0, 3.0, 4.0, 5.0], 64: [3.0, 4.0, 5.0, 6.0]})
    assert [costs.bucket(b) for b in (1, 2, 4, 5, 64, 200)] == [1, 4, 4, 16, 64, 64]
    assert costs.seconds(3) == [1.0, 2.0, 3.0, 4.0] and costs.seconds(1) == [None] * (K + 1)
    costs.observe(3, 1, 2.5)  # measured: it replaces the prior, and what serving added carries to rounds
    assert costs.seconds(4) == [1.0, 2.5, 3.5, 4.5]
    assert costs.seconds(16) == [2.0, 3.5, 4.5, 5.5] and costs.seconds(64) == [3.0, 4.5, 5.5, 6.5]
    costs.observe(4, 1, 3.5)  # the median of the last `window` measurements
    assert costs.seconds(4)[1] == pytest.approx(3.0)
    costs.observe(4, 1, 30.0)  # one slow step moves it to the next measurement, no further
    assert costs.seconds(4)[1] == pytest.approx(3.5)
    for seconds in [2.0] * costs.window:  # the oldest leave the window
        costs.observe(4, 1, seconds)
    assert costs.seconds(4)[1] == pytest.approx(2.0)
    costs.restart(4, 1)  # the figure stands until the next measurement, which starts it afresh
    assert costs.seconds(4)[1] == pytest.approx(2.0)
    costs.observe(4, 1, 2.7)
    assert costs.seconds(4)[1] == pytest.approx(2.7)
    costs.observe(16, 3, 5.0)  # the nearest measured round of a bucket first, then of the nearest bucket
    costs.observe(16, 0, 2.5)
    assert costs.seconds(16) == pytest.approx([2.5, 3.0, 4.0, 5.0])
    assert costs.seconds(64) == pytest.approx([3.5, 4.0, 5.0, 6.0])
    assert costs.seconds(4) == pytest.approx([1.5, 2.7, 3.7, 4.7])  # (the nearest bucket, larger or not)
    assert costs.change_seconds(16, SWITCH) == 0.0
    costs.observe_change(4, SWITCH, 2.0)  # a bucket without a figure of its own takes the nearest smaller one's
    costs.observe_change(64, EXCURSION, 3.0)
    assert costs.change_seconds(16, SWITCH) == 2.0 and costs.change_seconds(16, EXCURSION) == 0.0
    assert costs.change_seconds(64, EXCURSION) == 3.0 and costs.change_seconds(1, SWITCH) == 0.0
    for call, args in (
        (costs.observe, (4, K + 1, 1.0)),
        (costs.observe, (4, 0, 0.0)),
        (costs.set_prior, (3, 0, 1)),
        (costs.observe_change, (4, "flap", 1.0)),
    ):
        with pytest.raises(ValueError, match="cost model"):
            call(*args)


def test_priors_the_host_makes_wrong_are_corrected_by_what_was_measured():
    """Start-up replays make a round look twice a plain step; serving measures rounds several
    times dearer (the host's work per request): the controller leaves num_steps for plain steps,
    which it has not measured either (a round's host work says nothing of theirs), and keeps
    them without trying the other draft lengths, whose estimates carry what serving added to
    num_steps's; nor does it try rounds at a batch size it never served."""
    replays, measured = [0.1, 0.2, 0.25, 0.3], [0.6, 3.0, 4.2, 5.3]
    ctrl = AdaptiveDraftSteps(_costs({16: replays, 64: [2 * s for s in replays]}))
    chosen = _drive(ctrl, 16, _tokens(16, 0.8), 40, lambda k: measured[k])
    assert chosen == [K] * 4 + [0] * 36
    assert ctrl.costs.seconds(16) == pytest.approx([0.6, 5.2, 5.25, 5.3])
    assert set(_drive(ctrl, 64, _tokens(64, 0.8), 40, lambda k: 2 * measured[k])) == {0}


def test_acceptance_counts_judge_positions_up_to_the_first_rejection():
    model = AcceptanceModel(K, rows=4, prior=1.0, pseudo_counts=4.0)
    model.start([0, 1])
    model.record([0, 1], 3, [1, 3])  # row 0: accepted draft 1, rejected 2, never judged 3
    assert model.judged[0].tolist() == [1, 1, 0] and model.accepted[0].tolist() == [1, 0, 0]
    assert model.judged[1].tolist() == [1, 1, 1] and model.accepted[1].tolist() == [1, 1, 1]
    assert model.draft_rates().tolist() == pytest.approx([1.0, 2 / 3, 1.0])
    for _ in range(50):  # row 0 keeps rejecting its first draft: it expects less than the draft
        model.record([0], 2, [0])
    low, high = model.expected_tokens([0])[K], model.expected_tokens([1])[K]
    assert 1.0 <= low < 1.5 < high
    assert model.expected_tokens([0, 1])[0] == 2.0  # k = 0: one token each
    rates = model.rates([1])[0]
    assert model.expected_tokens([1])[2] == pytest.approx(1 + rates[0] + rates[0] * rates[1])
    model.start([0])  # a new request on row 0 starts at the draft's rates
    assert model.rates([0])[0] == pytest.approx(model.draft_rates())
    with pytest.raises(ValueError, match="acceptance"):
        model.record([0], 2, [3])


def test_the_controller_picks_the_fastest_draft_length_per_batch_size():
    """Rounds cost little more than a plain step at batch 1 and several at batch 64 (as on a
    GPU): with acceptance 0.8 the controller runs K drafts at batch 1 and plain steps at 64, and
    plain steps at batch 1 too once drafts are never accepted."""
    rows = {1: [1.0, 1.2, 1.4, 1.6], 4: [1.0, 1.3, 1.6, 1.9], 16: [1.0, 2.0, 3.0, 4.0], 64: [1.0, 3.0, 5.0, 7.0]}
    for batch, rate, want in ((1, 0.8, K), (64, 0.8, 0), (1, 0.0, 0), (4, 0.5, 1)):
        ctrl = AdaptiveDraftSteps(_costs(rows))
        chosen = _drive(ctrl, batch, _tokens(batch, rate), 40)
        assert chosen[:4] == [K] * 4  # num_steps first, for `dwell` steps
        assert ctrl.k == want and chosen[-10:].count(want) >= 9, (batch, rate, chosen)  # (a probe, at most)


def test_the_controller_does_not_flap_between_near_equals():
    """k = 1 and k = 2 within 2% of each other, step times noisy by 5%: once settled the
    controller keeps one of them, leaving it only for single probes a step deeper (ever rarer)
    and a re-check of plain steps (`dwell` of them after `settle_steps`, no sooner than their
    loss is 1% of the time since); a clear winner (25% faster) it takes."""
    rows = {4: [1.0, 1.0, 1.0, 3.0]}
    tokens = np.array([4.0, 7.0, 7.14, 7.2])
    rng = np.random.default_rng(0)
    ctrl = AdaptiveDraftSteps(_costs(rows))
    settled = _drive(ctrl, 4, tokens, 700, lambda k: rows[4][k] * rng.uniform(0.95, 1.05))[10:]
    k, stay = ctrl.k, ctrl.stay_after_change
    rechecks = "".join(map(str, settled)).split("0" * stay)
    assert k in (1, 2) and len(rechecks) == 2 and len(rechecks[0]) >= 0.95 * stay * (1 - 4 / 7) / 0.01 - 10
    assert 0 not in settled[: settled.index(0)] + settled[settled.index(0) + stay :]
    assert settled.count(k) >= len(settled) - 6 - stay
    probes = [i for i, n in enumerate(settled) if n not in (k, 0)]
    assert all(settled[i] == k + 1 and settled[i + 1] == k for i in probes)
    assert _drive(ctrl, 4, np.array([4.0, 9.0, 7.2, 7.2]), 10)[-1] == 1


def test_the_controller_measures_what_it_has_not_and_probes_deeper():
    """Without start-up timing (a CPU) every k is tried for `dwell` steps, deepest first, before
    the fastest is chosen; a step right after a change is not timed, nor the `settle_steps` from
    a change between rounds and plain steps, which run for that many more. At k = 0 it probes k = 1
    after `probe_after` steps, and waits twice as long after a probe that changed nothing
    (probes as cheap as the time allows: `probe_share` 1)."""
    times = [1.0, 1.5, 2.0, 2.5]
    ctrl = AdaptiveDraftSteps(
        CostModel(BUCKETS, K), dwell=3, plain_dwell=3, probe_after=8, max_probe_after=32, probe_share=1.0
    )
    chosen = _drive(ctrl, 4, _tokens(4, 0.1), 9 + ctrl.stay_after_change, lambda k: times[k])
    assert chosen[:9] == [3, 3, 3, 2, 2, 2, 1, 1, 1] and chosen[9:] == [0] * ctrl.stay_after_change
    assert ctrl.costs.seconds(4) == times  # each measured, the first steps after a change left out
    chosen = _drive(ctrl, 4, _tokens(4, 0.1), 120, lambda k: times[k])
    probes = [i for i, k in enumerate(chosen[:-1]) if k == 1]
    assert len(probes) >= 3 and all(chosen[i + 1] == 0 for i in probes) and set(chosen) == {0, 1}
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[1] > gaps[0] and gaps[-1] <= 32 + 2 * 3  # (decisions come every `dwell` steps here)
    went = _drive(ctrl, 4, _tokens(4, 0.99), ctrl.max_probe_after + 1, lambda k: times[k])  # (a decision comes)
    assert K in went and set(went[went.index(K) :]) == {K}  # drafts accepted: they pay now


def test_at_plain_steps_the_controller_decides_ever_less_often_until_the_batch_changes():
    """Settled at plain steps, a decision (what the acceptance model expects, asked) comes after
    `plain_dwell` steps, then twice as long after each that kept plain steps, up to
    `max_plain_dwell`, while the batch size stays, and within `dwell` steps of a change of it: a
    batch whose drafts now pay leaves plain steps at once."""
    rows = {4: [1.0, 3.0, 5.0, 7.0], 16: [1.0, 1.1, 1.2, 1.3]}
    ctrl = AdaptiveDraftSteps(_costs(rows), probe_after=10_000, max_probe_after=10_000)
    assert _drive(ctrl, 4, _tokens(4, 0.8), 40)[-1] == 0
    asked = []

    def tokens_of(batch: int, rate: float):
        def ask():
            asked.append(batch)
            return _tokens(batch, rate)

        return ask

    chosen, asked_at = [], []
    for step in range(1200):
        k = ctrl.choose(4, tokens_of(4, 0.8))
        ctrl.observe(4, k, ctrl.costs.seconds(4)[k])
        chosen.append(k)
        if len(asked) > len(asked_at):
            asked_at.append(step)
    gaps = np.diff(asked_at).tolist()
    assert set(chosen) == {0} and gaps[0] >= 2 * ctrl.plain_dwell and gaps[-2:] == [ctrl.max_plain_dwell] * 2
    assert all(b == min(2 * a, ctrl.max_plain_dwell) for a, b in itertools.pairwise(gaps)), gaps
    asked.clear()
    asked_at.clear()
    for step in range(100):  # another batch size, plain steps still best: the wait starts afresh
        k = ctrl.choose(3, tokens_of(3, 0.8))  # (batch 3: bucket 4's costs)
        ctrl.observe(3, k, ctrl.costs.seconds(3)[k])
        if len(asked) > len(asked_at):
            asked_at.append(step)
    first = asked_at[0]
    assert first < ctrl.dwell and asked_at[1:] == [first + ctrl.plain_dwell, first + 3 * ctrl.plain_dwell], asked_at
    asked.clear()
    for _ in range(ctrl.dwell):
        if ctrl.choose(16, tokens_of(16, 0.8)):
            break
        ctrl.observe(16, 0, 1.0)
    assert asked == [16] and ctrl.choose(16, tokens_of(16, 0.8)) == K  # (asked again: the same answer)


def test_a_change_between_plain_steps_and_rounds_must_repay_what_it_was_measured_to_cost():
    """The first step after each change takes `change` seconds more (a pipeline drained, a draft
    caught up): the controller measures it as the switch's cost; a round length 6% faster than
    plain steps saves less than that within `payback` steps and is not taken (a controller whose
    changes cost nothing takes it), one 50% faster is."""
    rows = {4: [1.0, 2.0, 2.5, 3.0]}
    worse, slightly, clearly = _tokens(4, 0.2), np.array([4.0, 8.48, 8.6, 8.7]), np.array([4.0, 12.0, 12.5, 13.0])
    dear, free = AdaptiveDraftSteps(_costs(rows)), AdaptiveDraftSteps(_costs(rows))
    for ctrl, change in ((dear, 10.0), (free, 0.0)):
        assert _drive(ctrl, 4, worse, 40, change=change) == [K] * 4 + [0] * 36
    assert dear.costs.change_seconds(4, SWITCH) == pytest.approx(10.0) and free.costs.change_seconds(4, SWITCH) == 0.0
    # (600 steps: decisions at plain steps come ever less often, three of them here)
    assert set(_drive(dear, 4, slightly, 600, change=10.0)) == {0}  # 64 steps x 2 s x 6% = 7.7 s < 10 s
    assert _drive(free, 4, slightly, 600)[-1] == 1
    assert _drive(dear, 4, clearly, 600, change=10.0)[-1] == 1


def _host(plain):
    """Step times: rounds of k drafts 1.4, 1.6, 1.8 s (k = 1..3); the nth plain step since the
    last round `plain(n)` s."""
    since = [0]

    def seconds(k: int) -> float:
        if k:
            since[0] = 0
            return [0.0, 1.4, 1.6, 1.8][k]
        since[0] += 1
        return plain(since[0])

    return seconds


def test_one_slow_step_does_not_drive_the_controller_from_plain_steps_and_a_stale_figure_is_rechecked():
    """Plain steps (0.4 s) beat rounds of K drafts (1.8 s for 3.5 tokens). Every 8th plain step
    takes 2 s (a host's pauses): it stays at plain steps (their mean, 0.6 s, is worse than rounds;
    a moving average weighing the last step 0.2 made one such step before a decision 0.72 s). When
    plain steps alone are slow for a stretch (1.2 s, rounds unchanged: more than the host's drift,
    which the rounds' figure follows up to `MAX_DRIFT`, explains) it goes back to rounds; once
    they are fast again it re-checks plain steps from rounds within the wait `probe_share`
    allows (two switches, as measured, and the loss of `stay_after_change` plain steps, at most
    1% of the time at rounds) and keeps them."""
    rows = {1: [0.35, 0.6, 0.7, 0.8]}
    tokens = np.array([1.0, 1.9, 2.7, 3.5])

    def host(plain: float):
        return _host(lambda n: 2.0 if n % 8 == 0 else plain)

    ctrl = AdaptiveDraftSteps(_costs(rows))
    chosen = _drive(ctrl, 1, tokens, 200, host(0.4), change=1.0)
    assert chosen[:4] == [K] * 4 and set(chosen[4:]) == {0}
    slow = _drive(ctrl, 1, tokens, 40, host(1.2), change=1.0)
    assert slow[-1] == K and ctrl.costs.seconds(1)[0] == pytest.approx(1.2)
    switch = ctrl.costs.change_seconds(1, SWITCH)
    chosen = _drive(ctrl, 1, tokens, 800, host(0.4), change=1.0)
    rounds = slow[::-1].index(0) + chosen.index(0)  # steps at rounds before the re-check
    wait = (2 * switch + ctrl.stay_after_change * (1.2 - 1.8 / 3.5)) / (ctrl.probe_share * 1.8)
    assert wait <= rounds <= wait + ctrl.dwell and set(chosen[chosen.index(0) :]) == {0}, rounds


def test_entries_not_being_measured_follow_the_hosts_drift_and_change_costs_average_both_ways():
    """Once the entry measured now holds a full window, the others of its bucket are read scaled by
    how far its figure moved since (no further than `MAX_DRIFT`); an entry measured afresh moves
    nothing else; changes are averaged as measured, below zero too, and read no lower than 0."""
    costs = _costs({4: [1.0, 2.0, 3.0, 4.0], 16: [2.0, 3.0, 4.0, 5.0]})
    for k, seconds in ((0, 1.0), (K, 4.0)):
        for _ in range(costs.window):
            costs.observe(4, k, seconds)
        costs.seconds(4)
    for seconds in [6.0] * costs.window:  # rounds 1.5x slower: the host's, and plain steps follow
        costs.observe(4, K, seconds)
    assert costs.seconds(4)[0] == pytest.approx(1.5) and costs.seconds(4)[K] == pytest.approx(6.0)
    assert costs.seconds(16)[0] == pytest.approx(2.0 + 0.5)  # (a prior and what serving added to the nearest, drifted)
    for seconds in [24.0] * costs.window:  # 6x: no further than MAX_DRIFT
        costs.observe(4, K, seconds)
    assert costs.seconds(4)[0] == pytest.approx(MAX_DRIFT)
    costs.restart(4, 0)  # back at plain steps: measured afresh, which moves nothing else
    costs.observe(4, 0, 0.5)
    assert costs.seconds(4)[0] == pytest.approx(0.5) and costs.seconds(4)[K] == pytest.approx(24.0)
    for seconds in [1.0] * (costs.window - 1):  # the window fills: from here on, its changes are the host's
        costs.observe(4, 0, seconds)
    assert costs.seconds(4) == pytest.approx([1.0, 22.0, 23.0, 24.0])  # (unmeasured rounds: prior + what K added)
    for seconds in [0.75] * costs.window:
        costs.observe(4, 0, seconds)
    assert costs.seconds(4)[K] == pytest.approx(18.0)
    costs.observe_change(4, SWITCH, -2.0)  # faster than the entries: averaged as measured, read no lower than 0
    assert costs.change_seconds(4, SWITCH) == 0.0
    for _ in range(40):
        costs.observe_change(4, SWITCH, 3.0)
    costs.observe_change(4, SWITCH, -2.0)
    assert costs.change_seconds(4, SWITCH) == pytest.approx(2.0, abs=0.01)


def test_a_slow_stretch_of_the_whole_host_leaves_the_controller_at_plain_steps(monkeypatch):
    """Plain steps (0.4 s) beat rounds of K drafts (1.8 s for 3.5 tokens); then the host runs 2.5x
    slower for a stretch, every step alike: the rounds' figure follows the plain steps' and the
    controller stays at plain steps, which still win. With figures that stay as last measured
    (`MAX_DRIFT` 1) the stale rounds look faster than the slow plain steps: it goes to rounds,
    slower than the plain steps it left, until a re-check."""
    rows = {1: [0.35, 0.6, 0.7, 0.8]}
    tokens = np.array([1.0, 1.9, 2.7, 3.5])
    speed = [1.0, 1.4, 1.6, 1.8]

    def host(factor: float):
        return lambda k: factor * (0.4 if k == 0 else speed[k])

    for drift, kept in ((MAX_DRIFT, True), (1.0, False)):
        monkeypatch.setattr(cost_model, "MAX_DRIFT", drift)
        ctrl = AdaptiveDraftSteps(_costs(rows))
        assert K not in _drive(ctrl, 1, tokens, 200, host(1.0))[4:]
        chosen = _drive(ctrl, 1, tokens, 100, host(2.5)) + _drive(ctrl, 1, tokens, 100, host(1.0))
        assert (K not in chosen) == kept and chosen[-1] == 0, "".join(map(str, chosen))


def test_the_steps_right_after_rounds_count_towards_the_change_and_a_re_check_finds_plain_steps_fast():
    """Plain steps (0.4 s) beat rounds of K drafts (1.8 s for 3.5 tokens), but the first 4 plain
    steps after rounds take 1.0 s (as on a GPU host: the pipeline and the host warm up again).
    After a slow stretch has sent the controller to rounds, a re-check of plain steps times them
    only after `settle_steps`: it finds them fast and keeps them, the slow steps counted towards
    the switch. A controller timing them from the second step (`settle_steps` 1) finds them as
    slow as the stretch left them and stays at rounds for good."""
    rows = {1: [0.35, 0.6, 0.7, 0.8]}
    tokens = np.array([1.0, 1.9, 2.7, 3.5])

    def host(plain: float):
        return _host(lambda n: 1.0 if n <= 4 else plain)

    for settle_steps, back in ((8, True), (1, False)):
        ctrl = AdaptiveDraftSteps(_costs(rows), settle_steps=settle_steps)
        assert _drive(ctrl, 1, tokens, 60, host(1.0))[-1] == K  # (a slow stretch: rounds pay)
        chosen = _drive(ctrl, 1, tokens, 3000, host(0.4))
        assert chosen.count(0) > 0  # re-checked
        assert (chosen[-200:] == [0] * 200) == back, "".join(map(str, chosen))
        if back:
            assert ctrl.costs.seconds(1)[0] == pytest.approx(0.4)
            assert ctrl.costs.change_seconds(1, SWITCH) > 0.0  # (the slow steps, beyond plain steps' entry)


def test_a_step_of_unknown_time_leaves_later_changes_measured():
    """A decode step right after a prefill has no decode step before it to time from: it counts
    towards no change, and the next change (a plain step 10 s dearer than its entry) is measured
    as usual."""
    ctrl = AdaptiveDraftSteps(_costs({4: [1.0, 2.0, 3.0, 4.0]}))
    ctrl.observe(4, K, None)
    for seconds in [4.0] * 6 + [11.0] + [1.0] * (ctrl.settle_steps + 2):  # steady rounds, a change, plain steps
        ctrl.observe(4, K if seconds == 4.0 else 0, seconds)
    assert ctrl.costs.change_seconds(4, SWITCH) == pytest.approx(10.0)


def test_probes_from_plain_steps_cost_at_most_their_share_of_the_time():
    """Plain steps are fastest and every change costs 5 s more: probes from plain steps (a round
    and back, 10 s beyond their steps, and the round's own loss against plain steps) come no more
    often than keeps them to `probe_share` (1%) of the time, yet still come."""
    times = [1.0, 1.5, 2.0, 2.5]
    ctrl = AdaptiveDraftSteps(CostModel(BUCKETS, K))
    chosen = _drive(ctrl, 1, _tokens(1, 0.3), 4000, lambda k: times[k], change=5.0)
    explored = 4 * (K + 1)
    assert chosen[:explored] == [k for k in range(K, -1, -1) for _ in range(4)]
    probes = [i for i, k in enumerate(chosen) if i >= explored and k]
    assert set(chosen[explored:]) == {0, 1} and 2 <= len(probes) <= 4, probes
    assert ctrl.costs.change_seconds(1, EXCURSION) == pytest.approx(10.0)
    assert all(b - a >= (10.0 + 1.5 - 1.3) / 0.01 for a, b in itertools.pairwise(probes))


def test_no_probe_from_plain_steps_while_no_round_could_beat_them_with_every_draft_accepted():
    """Rounds of k drafts cost k + 1.2 plain steps: accepting every draft they would still yield
    fewer tokens a second than plain steps, so once at plain steps the controller never probes
    from them (what a probe learns, the acceptance, could not change its choice); rounds a little
    cheaper than k + 1 plain steps are probed (the test above)."""
    dear = [1.0] + [k + 1.2 for k in range(1, K + 1)]
    ctrl = AdaptiveDraftSteps(CostModel(BUCKETS, K))
    chosen = _drive(ctrl, 1, _tokens(1, 0.3), 4000, lambda k: dear[k])
    explored = [k for k in range(K, 0, -1) for _ in range(ctrl.dwell)]
    assert chosen[: len(explored)] == explored and set(chosen[len(explored) :]) == {0}


class _NoHotEntry(CostModel):
    """The cost model without its shortcut for a repeated measurement."""

    def observe(self, batch_size, k, seconds):
        self._hot = None
        super().observe(batch_size, k, seconds)


def test_the_cost_models_shortcut_for_repeated_measurements_keeps_what_the_whole_path_does():
    """Runs of measurements of the same step append to their entry directly, and several taken in
    at once (`observe_all`) extend it; over random runs (batch sizes sharing a bucket, entries
    restarted and read between them) the figures are the whole path's, one at a time."""
    rng = np.random.default_rng(3)
    fast, whole = CostModel(BUCKETS, K, window=4), _NoHotEntry(BUCKETS, K, window=4)
    batch, k = 2, 0
    for _ in range(4000):
        if rng.random() < 0.05:
            batch, k = int(rng.choice([1, 2, 3, 4, 9, 64])), int(rng.integers(0, K + 1))
        seconds = [float(t) for t in rng.uniform(0.5, 2.0, size=int(rng.choice([1, 1, 1, 2, 7])))]
        fast.observe_all(batch, k, seconds) if len(seconds) > 1 else fast.observe(batch, k, seconds[0])
        for each in seconds:
            whole.observe(batch, k, each)
        if rng.random() < 0.03:
            for model in (fast, whole):
                model.restart(batch, k)
        if rng.random() < 0.1:
            read = int(rng.choice([1, 3, 16]))
            assert fast.seconds(read) == whole.seconds(read)
    assert {b: fast.seconds(b) for b in BUCKETS} == {b: whole.seconds(b) for b in BUCKETS}
    assert fast.measured == whole.measured and len(fast.measured) > 8
    with pytest.raises(ValueError, match="positive time"):
        fast.observe_all(1, 0, [1.0, 0.0])


class _AlwaysAccounting(AdaptiveDraftSteps):
    """The controller without its shortcut for steady steps: every step through the whole
    bookkeeping."""

    def observe(self, batch_size, k, seconds, clean=True):
        self._calm = False
        super().observe(batch_size, k, seconds, clean)


def test_the_shortcut_for_steady_steps_leaves_the_controller_as_the_whole_bookkeeping_does():
    """Steady steps skip the controller's bookkeeping (a plain step's host time counts on a
    host-bound model): over random runs of steps (batch sizes changing now and then, slow, unclean
    and unknown-time steps, the steps a relayed group runs regardless of the choice), the
    controller with the shortcut chooses, and ends in, what the one without it does."""
    rng = np.random.default_rng(7)
    times = {b: [b * (1.0 + 0.6 * k) for k in range(K + 1)] for b in BUCKETS}
    fast, whole = AdaptiveDraftSteps(CostModel(BUCKETS, K)), _AlwaysAccounting(CostModel(BUCKETS, K))
    shortcuts = 0
    for batch, tokens in _random_batches(rng, 3000, 4, 0.7, 0.01):
        k = fast.choose(batch, lambda tokens=tokens: tokens)
        assert whole.choose(batch, lambda tokens=tokens: tokens) == k
        told = _random_tell(rng, times, fast.costs.bucket, batch, k)
        shortcuts += fast._calm and told[1] == fast.k and told[2] is not None and told[3]
        fast.observe(*told)
        whole.observe(*told)
        state = {n: v for n, v in vars(fast).items() if n not in ("costs", "_calm")}
        assert state == {n: v for n, v in vars(whole).items() if n not in ("costs", "_calm")}
        assert fast.costs.seconds(batch) == whole.costs.seconds(batch)
    assert shortcuts > 1000 and len(set(fast.costs.measured)) > 8


def _random_batches(rng, steps: int, batch: int, rate: float, change: float):
    """`steps` decode steps' batch sizes and expected tokens: a new batch size and acceptance
    rate at a step with probability `change`."""
    for _ in range(steps):
        if rng.random() < change:
            batch, rate = int(rng.choice([1, 3, 4, 16, 40])), float(rng.uniform(0.1, 0.9))
        yield batch, _tokens(batch, rate)


def _random_tell(rng, times: dict, bucket, batch: int, k: int) -> tuple:
    """What a decode step chosen at `k` tells: now and then a k a relayed group ran whatever this
    rank chose, its time from `times` (per `bucket(batch)` and k) with noise, now and then unknown
    or unclean."""
    if rng.random() < 0.01:
        k = int(rng.integers(0, K + 1))
    seconds = times[bucket(batch)][k] * float(rng.lognormal(0.0, 0.3))
    return (batch, k, None if rng.random() < 0.01 else seconds, rng.random() > 0.02)


def _ask(ctrl: AdaptiveDraftSteps, batch: int, tokens) -> int:
    """Ask for a step's k as the speculative worker does: a leased plain step without asking."""
    lease = ctrl.lease
    if lease.steps and batch == lease.batch_size:
        lease.steps -= 1
        return 0
    return ctrl.choose(batch, tokens)


def _tell(ctrl: AdaptiveDraftSteps, batch: int, k: int, seconds, clean: bool) -> None:
    """Tell a step as the engine does: a leased plain step's time kept in the lease."""
    lease = ctrl.lease
    if lease.seconds is not None and batch == lease.batch_size and k == 0 and clean and seconds is not None:
        lease.seconds.append(seconds)
    else:
        ctrl.observe(batch, k, seconds, clean)


def _state(ctrl: AdaptiveDraftSteps) -> dict:
    return {n: v for n, v in vars(ctrl).items() if n not in ("costs", "lease", "leases")}


def test_plain_steps_leased_ahead_leave_the_controller_as_asking_every_step_does():
    """Plain steps granted ahead are neither asked for nor told one by one: over random runs
    (plain steps the fastest at most batch sizes, batch sizes changing now and then, slow,
    unclean and unknown-time steps, steps a relayed group runs regardless of the choice, two
    asks without a tell between, as a launched step and the next one make), the leasing
    controller runs every step's k and ends where the one asked and told every step does."""
    rng = np.random.default_rng(11)
    times = {b: [b * (1.0 + (0.6 if b > 4 else 0.05) * k) for k in range(K + 1)] for b in BUCKETS}
    leasing, asked = AdaptiveDraftSteps(CostModel(BUCKETS, K)), AdaptiveDraftSteps(CostModel(BUCKETS, K), leases=False)
    leased = 0
    for batch, tokens in _random_batches(rng, 4000, 16, 0.3, 0.005):
        leased += bool(leasing.lease.steps) and batch == leasing.lease.batch_size
        for _ in range(2 if rng.random() < 0.01 else 1):  # (twice: a launched step and the next)
            k = _ask(leasing, batch, lambda tokens=tokens: tokens)
            assert asked.choose(batch, lambda tokens=tokens: tokens) == k
        told = _random_tell(rng, times, leasing.costs.bucket, batch, k)
        _tell(leasing, *told)
        asked.observe(*told)
        assert asked.lease.seconds is None  # (a controller that leases nothing: a relayed group's lead)
    leasing.choose(batch, lambda: tokens)  # (takes in what the lease holds)
    asked.choose(batch, lambda: tokens)
    assert _state(leasing) == _state(asked)
    assert {b: leasing.costs.seconds(b) for b in BUCKETS} == {b: asked.costs.seconds(b) for b in BUCKETS}
    assert leased > 1500 and leasing.costs.measured == asked.costs.measured


# -- engines on a forced schedule ------------------------------------------------------------------
SCHEDULE = [K, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0, K, 2, 2, 0]  # rounds of every k, plain runs past max_lag
PROMPTS = [[5, 17, 99, 3, 250, 1000, 7, 8, 9, 10] * 2, [11, 12, 13, 14] * 3]
GREEDY = SamplingParams(max_new_tokens=28, temperature=0.0, ignore_eos=True)


def _tiny(graphs, speculative=None, **kw) -> Engine:
    kw = {"context_length": 96, "max_running_requests": 2, **kw}
    return Engine(
        model=DEFAULT_MODEL,
        page_size=16,
        attention_backend="trtllm_mha",
        max_total_tokens=2048,
        cuda_graphs=graphs,
        speculative=speculative,
        **kw,
    )


@pytest.fixture(scope="module")
def plain_tokens():
    return [o.token_ids for o in _tiny(False).generate(prompt_token_ids=PROMPTS, sampling=GREEDY)]


@pytest.mark.parametrize(
    "algorithm, graphs, overlap",
    [(a, False, False) for a in sorted(DRAFT_MODELS)]
    + [(a, "emulate", True) for a in sorted(DRAFT_MODELS)]
    + [("eagle", "emulate", False)],  # plain steps replayed without overlap: the hidden states a head reads
)
def test_switching_between_plain_steps_and_rounds_is_lossless(plain_tokens, algorithm, graphs, overlap):
    """The shipped tiny target and each of its drafts, the draft length forced through every k
    and runs of plain steps longer than `max_lag`: greedy tokens equal plain decoding's; rounds
    of each k ran (under replay, from graphs captured for that k), plain steps ran (overlapped:
    each launched before the last one's read, the hidden states the draft reads kept by the
    decode graph) and the draft caught up after them; every pool is back at its free count."""
    spec = {"algorithm": algorithm, "draft_model": DRAFT_MODELS[algorithm], "num_steps": K}
    eng = _tiny(graphs, spec, overlap_schedule=overlap)
    eng.spec.controller, eng.spec.max_lag = Schedule(SCHEDULE), 4
    outs = eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY)
    assert [o.token_ids for o in outs] == plain_tokens
    assert {k for o in outs for k in o.spec.draft_steps} == {1, 2, K}
    assert all(o.spec.plain_steps > 0 and len(o.spec.draft_steps) == o.spec.verify_steps for o in outs)
    assert all(n <= k + 1 for o in outs for n, k in zip(o.spec.accept_lengths, o.spec.draft_steps))
    assert eng.spec.catch_ups > 0
    if graphs:
        verifies = {key.q_len for key in eng.runner.graphs.families if key.mode is ForwardMode.TARGET_VERIFY}
        assert verifies == {2, 3, K + 1}
    eng.check_no_leak()


class Told(Schedule):
    """A forced schedule that keeps what the controller is told: (k, seconds, clean) per step."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(ks)
        self.told: list[tuple[int, float | None, bool]] = []

    def observe(self, batch_size, k, seconds, clean=True) -> None:
        super().observe(batch_size, k, seconds, clean)
        self.told.append((k, seconds, clean))


def test_the_controller_is_told_which_steps_are_their_kinds(plain_tokens):
    """Overlapped plain steps between rounds of K frozen-KV drafts launched ahead, under emulated replay:
    the controller is told every round and every plain step but the launch that restarts the
    pipeline (its time goes with the step after it); the plain step whose time holds the round
    launched ahead and dropped is not clean, nor the round whose draft caught up first; every
    other step between the first and the last (whose round ahead its finished requests drop) is."""
    spec = {"algorithm": "frozen_kv_mtp", "draft_model": DRAFT_MODELS["frozen_kv_mtp"], "num_steps": K}
    eng = _tiny("emulate", spec, overlap_schedule=True)
    eng.spec.controller = told = Told([K, K, K, 0, 0, 0, 0])
    outs = eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY)
    assert [o.token_ids for o in outs] == plain_tokens
    assert eng.spec.rounds_drafted_ahead > 0 and eng.spec.drops > 0
    ks = [k for k, _, _ in told.told]
    assert ks == [[K, K, K, 0, 0, 0, 0][i % 7] for i in range(len(ks))]
    assert all(seconds is not None for _, seconds, _ in told.told[1:])
    for i, (k, _, clean) in enumerate(told.told[1:-1], 1):
        changed = k != ks[i - 1]
        # (a change to plain steps drops a round launched ahead; to rounds, the draft catches up)
        assert clean == (not changed), (i, [(k, c) for k, _, c in told.told])
    assert sum(o.spec.plain_steps for o in outs) > ks.count(0) * len(PROMPTS) / 2
    eng.check_no_leak()


class AsyncDevice:
    """A GPU's one stream, emulated in virtual nanoseconds: launched work runs in order after the
    work before it, a read waits for the work it reads (all of it, unnamed), and the host's clock
    moves on by `host` a look."""

    def __init__(self, host: int) -> None:
        self.now_ns, self.free_ns, self.host = 0, 0, host

    def time_ns(self) -> int:
        self.now_ns += self.host
        return self.now_ns

    def launch(self, ns: int) -> int:
        self.free_ns = max(self.free_ns, self.now_ns) + ns
        return self.free_ns

    def wait(self, done_ns: int | None) -> None:
        self.now_ns = max(self.now_ns, self.free_ns if done_ns is None else done_ns)


def test_a_catch_up_after_plain_steps_stays_out_of_their_time_on_an_asynchronous_device(monkeypatch):
    """A standalone draft with the target's own weights and a full pool of its own, catching up
    every few overlapped plain steps, on an emulated GPU stream (a plain step 1 ms, a round
    3 ms, a catch-up 20 ms): the catch-up, launched behind the next step in flight, holds up
    the step after that one, which is then not clean; every steady step told clean took what a
    plain step costs, so the controller's k = 0 entry measures plain steps alone."""
    import workers.engine as engine
    import workers.speculative.worker as worker
    from workers.overlap import InFlight

    plain_ns, round_ns, catch_up_ns = 1_000_000, 3_000_000, 20_000_000
    device = AsyncDevice(host=1_000)
    monkeypatch.setattr(worker, "MAX_LAG", 2)
    spec = {"algorithm": "standalone", "draft_model": DEFAULT_MODEL, "num_steps": K, "draft_pool": "full"}
    eng = _tiny(False, spec, overlap_schedule=True)
    eng.spec.controller = told = Told([K] + [0] * 12)
    eng.spec.lag_tokens = 3 * len(PROMPTS)  # a catch-up every 3 plain steps

    def timed(ns, run):
        return lambda *args: (device.launch(ns), run(*args))[1]

    def launch(*args):
        flight = overlap_launch(*args)
        flight.done_ns = device.free_ns  # its forward's end
        return flight

    def waited(flight):  # a round's reads wait for everything launched
        device.wait(getattr(flight, "done_ns", None))
        return read(flight)

    overlap_launch, read = eng._overlap.launch, InFlight.read
    eng._overlap.forward = timed(plain_ns, eng._overlap.forward)
    eng._overlap.launch = launch
    eng.spec.decode_round = timed(round_ns, eng.spec.decode_round)
    eng.spec.drafter.catch_up = timed(catch_up_ns, eng.spec.drafter.catch_up)
    monkeypatch.setattr(InFlight, "read", waited)
    monkeypatch.setattr(engine, "time", types.SimpleNamespace(time_ns=device.time_ns))
    eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY)

    plain = [(s, clean) for (k, s, clean), (j, _, _) in zip(told.told[1:], told.told) if k == j == 0]
    held = [clean for s, clean in plain if s == pytest.approx((plain_ns + catch_up_ns) / 1e9, rel=1e-3)]
    assert held and not any(held)  # the plain steps whose time holds a catch-up
    steady = [s for s, clean in plain if clean]
    assert steady and steady == pytest.approx([plain_ns / 1e9] * len(steady), rel=1e-3)
    eng.check_no_leak()


def test_a_draft_with_full_kv_of_its_own_catches_up_when_a_round_comes(plain_tokens, monkeypatch):
    """An EAGLE head (a full draft pool) behind by plain steps catches up only before the next
    round, however many came (within `lag_tokens` draft positions over its requests, and no
    sooner than MAX_LAG steps); past that bound, during the plain steps. Greedy output stays
    plain decoding's."""
    import workers.speculative.worker as worker

    monkeypatch.setattr(worker, "MAX_LAG", 2)
    spec = {"algorithm": "eagle", "draft_model": DRAFT_MODELS["eagle"], "num_steps": K}
    for lag_tokens, plain_catch_ups in ((worker.LAG_TOKENS, False), (2 * len(PROMPTS), True)):
        eng = _tiny(False, spec)
        eng.spec.controller, eng.spec.lag_tokens = Schedule([K] + [0] * 9), lag_tokens
        at = _catch_ups_in(eng)
        outs = eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY)
        assert [o.token_ids for o in outs] == plain_tokens
        behind = [k for k in at if k is not None]  # (not a prefill's)
        assert behind and (0 in behind) == plain_catch_ups, behind
        eng.check_no_leak()


def test_a_draft_that_holds_nothing_while_behind_catches_up_only_before_a_round(tmp_path, monkeypatch):
    """A standalone draft of a target without sliding windows holds nothing while plain steps
    leave it behind: however far behind (past MAX_LAG steps and `lag_tokens`), it catches up only
    when a round comes, in one forward past a prefill chunk (an eager forward's host time is
    paid per forward), or in forwards of at most `catch_up_tokens` where that is less, and
    greedy output stays plain decoding's."""
    import workers.speculative.worker as worker

    target = str(tmp_path / "llama")
    make_tiny_model("llama", target)
    spec = {"algorithm": "standalone", "draft_model": make_perturbed_copy(target, str(tmp_path / "draft"), 0.05)}
    kwargs = dict(model=target, page_size=4, chunked_prefill_size=8, max_total_tokens=1024, max_running_requests=2)
    prompts = random_prompts([20, 12], vocab=256, seed=3)
    want = [o.token_ids for o in Engine(**kwargs).generate(prompt_token_ids=prompts, sampling=GREEDY)]
    monkeypatch.setattr(worker, "MAX_LAG", 2)
    for most in (None, 8):
        eng = Engine(**kwargs, speculative=spec | {"num_steps": K})
        assert eng.spec.catches_up_lazily
        eng.spec.controller, eng.spec.lag_tokens = Schedule([K] + [0] * 9), 2
        eng.spec.catch_up_tokens = most or eng.spec.catch_up_tokens
        forwards = _catch_up_forwards(eng)
        assert [o.token_ids for o in eng.generate(prompt_token_ids=prompts, sampling=GREEDY)] == want
        behind = [(k, n) for k, n in forwards if k is not None]  # (not a prefill's)
        assert behind and all(k == K for k, _ in behind), behind  # never during plain steps
        if most is None:  # a catch-up of 2 requests 9 plain steps behind: one forward
            assert sum(n >= 18 for _, n in behind) > 1, behind
        else:
            assert all(0 < n <= 8 for _, n in behind) and sum(n == 8 for _, n in behind) > 1, behind
        eng.check_no_leak()


def _catch_up_forwards(eng: Engine) -> list[tuple[int | None, int]]:
    """Each forward of the engine's draft catch-ups as it comes: (draft steps of the engine
    step it runs in, the entries it ran)."""
    forwards, catch_up = [], eng.spec.drafter.catch_up

    def counted(mode, reqs, hidden, most=None):
        entries = sum(r.spec.draft_len for r in reqs)
        catch_up(mode, reqs, hidden, most)
        forwards.append((eng.last_step.draft_steps, sum(r.spec.draft_len for r in reqs) - entries))

    eng.spec.drafter.catch_up = counted
    return forwards


def _run_counting_catch_up_lags(eng: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> tuple[list, list, dict]:
    """Run `jobs` (prompt, sampling) to the end: each request's tokens, the plain steps the draft
    was behind at each catch-up after plain steps, and each request's admission reservation (by
    job); at every step no request holds more SWA pages than its reservation."""
    lags, resume = [], eng.spec._resume

    def recorded(reqs):
        if eng.last_step.draft_steps == 0 and any(not r.finished for r in reqs):  # (not before a round)
            lags.append(eng.spec._lag)
        resume(reqs)

    eng.spec._resume = recorded
    sched, alloc, p = eng.scheduler, eng.allocator, eng.allocator.page_size
    rids = [eng.add_request(prompt, sampling) for prompt, sampling in jobs]
    outs, needs = {}, {}
    while eng.has_unfinished():
        for rid, new, _ in eng.step():
            outs.setdefault(rid, []).extend(new)
        for req in sched.running:
            needs[rids.index(req.rid)] = sched._needs[req.rid]
            held = -(-alloc.allocated_len(req.row) // p) - alloc.swa_start(req.row)
            assert held <= sched._needs[req.rid].swa_pages, req.rid
    return [outs[r] for r in rids], lags, needs


def test_an_swa_draft_falls_behind_as_far_as_admission_reserved_its_window(monkeypatch):
    """A standalone draft in an SWA pool, plain steps after its first round, requests running
    well past the window: it catches up once it is as many plain steps behind as the running
    requests' reserved SWA pages hold its window (`Scheduler.draft_lag_room`: a prompt's prefill
    chunk reserves room past the window, at least MAX_LAG, here 3 steps), the lesser room of the
    two prompts while both run (12 tokens: 8 steps) and the longer prompt's alone (20 tokens:
    16); no request ever holds more SWA pages than its admission reserved, and greedy output
    stays plain decoding's."""
    import workers.speculative.worker as worker

    monkeypatch.setattr(worker, "MAX_LAG", 3)
    sampling = SamplingParams(max_new_tokens=160, temperature=0.0, ignore_eos=True)
    kwargs = dict(model=DEFAULT_MODEL, page_size=16, attention_backend="trtllm_mha", max_total_tokens=2048)
    plain = [o.token_ids for o in Engine(**kwargs).generate(prompt_token_ids=PROMPTS, sampling=sampling)]
    spec = {"algorithm": "standalone", "draft_model": DRAFT_MODELS["standalone"], "num_steps": K}
    for prompts, want, rooms in ((PROMPTS, plain, {8}), (PROMPTS[:1], plain[:1], {16})):
        eng = Engine(**kwargs, speculative=spec)
        assert eng.spec.swa and eng.scheduler.draft_lag == 3 and eng.scheduler.lookahead == K + 1
        eng.spec.controller = Schedule([K] + [0] * sampling.max_new_tokens)
        outs, lags, needs = _run_counting_catch_up_lags(eng, [(prompt, sampling) for prompt in prompts])
        assert all(n.swa_pages < n.full_pages for n in needs.values())
        assert outs == want
        assert len(lags) > 4 and set(lags) == rooms, lags
        eng.check_no_leak()


def test_an_swa_draft_of_requests_whose_reservation_holds_all_their_pages_does_not_catch_up_on_plain_steps():
    """Requests that end within their SWA reservation (`kv_need`'s SWA pages equal its full
    pages: a window and a chunk of the prompt hold every page they may ever hold) set no bound
    on how far a standalone draft in an SWA pool falls behind: 70-odd plain steps run with no
    catch-up (the reserved room of a longer request would have caught up after 64); with a
    longer request beside them, its room bounds the draft again. No request holds more SWA
    pages than reserved, and greedy output stays plain decoding's."""
    spec = {"algorithm": "standalone", "draft_model": DRAFT_MODELS["standalone"], "num_steps": K}
    kwargs = dict(model=DEFAULT_MODEL, page_size=16, attention_backend="trtllm_mha", max_total_tokens=2048)
    short = SamplingParams(max_new_tokens=76, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_new_tokens=140, temperature=0.0, ignore_eos=True)
    for jobs, rooms in (([(PROMPTS[1], short)], set()), ([(PROMPTS[1], short), (PROMPTS[0], long)], {64})):
        plain = Engine(**kwargs)
        want = [plain.generate(prompt_token_ids=[p], sampling=s)[0].token_ids for p, s in jobs]
        eng = Engine(**kwargs, speculative=spec)
        eng.spec.controller = Schedule([K] + [0] * 200)
        outs, lags, needs = _run_counting_catch_up_lags(eng, jobs)
        assert needs[0].swa_pages == needs[0].full_pages  # the short request's reservation: all its pages
        assert outs == want
        assert set(lags) == rooms, lags
        eng.check_no_leak()


def _catch_ups_in(eng: Engine) -> list[int | None]:
    """The draft steps of the engine step each of its draft's catch-ups runs in, as they come."""
    at = []
    catch_up = eng.spec.drafter.catch_up

    def recorded(*args, **kwargs):
        at.append(eng.last_step.draft_steps)
        return catch_up(*args, **kwargs)

    eng.spec.drafter.catch_up = recorded
    return at


def test_plain_steps_skip_only_window_releases_that_free_nothing():
    """A standalone draft in an SWA pool holds its requests' SWA windows back while it is behind
    (`Scheduler.window_from`), so most plain steps of an adaptive engine leave every window
    where it was and skip the release (`SpecWorker.windows_moved`): after every step of
    overlapped plain runs, catch-ups and rounds, a release of every running request's window
    regardless frees nothing, although windows were released along the way."""
    spec = {"algorithm": "standalone", "draft_model": DRAFT_MODELS["standalone"], "num_steps": K}
    eng = Engine(
        model=DEFAULT_MODEL,
        page_size=4,
        max_total_tokens=1024,
        context_length=128,
        max_running_requests=2,
        overlap_schedule=True,
        speculative=spec,
    )
    eng.spec.controller, eng.spec.max_lag = Schedule([K] + [0] * 9), 4
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    for p in random_prompts([70, 50], vocab=2048, seed=5):
        eng.add_request(p, sampling)
    moved, skipped, freed = eng.scheduler.windows_moved, 0, 0
    while eng.has_unfinished():
        before, ended = eng.kv_stats()["swa_free"], eng.scheduler.finishes
        eng.step()
        skipped += not moved()
        after = eng.kv_stats()["swa_free"]
        freed += after > before and eng.scheduler.finishes == ended  # a window moved on
        eng.scheduler.windows_moved = lambda: True
        eng.scheduler.release_windows(eng.scheduler.running)
        eng.scheduler.windows_moved = moved
        assert eng.kv_stats()["swa_free"] == after, eng.last_step.draft_steps
    assert skipped > 10 and freed > 2 and eng.spec.catch_ups > 0
    eng.check_no_leak()


def _kept_hidden_checked(eng: Engine) -> tuple[list, list]:
    """Record every plain step's target hidden states as its forward produced them (overlapped or
    not), and compare each row an EAGLE head's catch-up reads with them: ((request, position) read
    wrong, the rows each catch-up read per request)."""
    produced = {}  # (request row, position) -> the hidden state its plain step produced, as it came
    plain_hidden, checked, wrong = eng.spec._plain_hidden, [], []

    def recording(forward):
        def recorded(batch):
            out = forward(batch)
            if batch.forward_mode is not ForwardMode.DECODE:
                return out
            hidden = out.hidden if out.hidden is not None else eng.spec.ring.view(batch.hidden_at, batch.batch_size)
            for row, position, state in zip(batch.req_pool_indices.tolist(), batch.positions.tolist(), hidden):
                produced[row, position] = state.clone()
            return out

        return recorded

    def compared(reqs):
        out = plain_hidden(reqs)
        for req in reqs:
            first, rows = out[req.rid]
            wrong.extend(
                (req.rid, first + i)
                for i, kept in enumerate(rows)
                if not torch.equal(kept, produced[req.row, first + i])
            )
            checked.append(len(rows))
        return out

    eng._overlap.forward, eng.runner.forward = recording(eng._overlap.forward), recording(eng.runner.forward)
    eng.spec._plain_hidden = compared
    return wrong, checked


def test_overlapped_plain_steps_keep_each_steps_own_hidden_states():
    """The target hidden states an EAGLE head's catch-up reads after overlapped plain steps are
    each step's own: each step is replayed (emulated) and launched before the one before it is
    committed, so a step's rows must be kept before the next replay: the decode graph writes
    them into the hidden ring at the rows staged for it (`workers/hidden_ring.py`); a copy
    taken from its static buffer after the next launch held the next step's."""
    spec = {"algorithm": "eagle", "draft_model": DRAFT_MODELS["eagle"], "num_steps": K}
    eng = _tiny("emulate", spec, overlap_schedule=True)
    eng.spec.controller = Schedule([K, *[0] * 8] * 3)
    wrong, checked = _kept_hidden_checked(eng)
    outs = eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY)
    assert not wrong, wrong  # (request, position) whose kept hidden state is another step's
    assert len(checked) >= 4 and min(checked) >= 4, checked
    assert all(o.spec.plain_steps > 0 for o in outs)
    assert eng.spec.ring is not None and eng.spec.ring.head > 0  # (kept in the ring)
    eng.check_no_leak()


def test_a_catch_up_reads_ring_rows_and_an_eager_steps_own_hidden_states_alike():
    """Graphs captured for one request: a plain step of two runs eagerly and keeps its own copy
    of its hidden states, a step of one, under (emulated) replay, keeps them in the ring as row
    numbers. Once the shorter request ends, a catch-up reads runs of both kinds at once, each row
    its own step's, and greedy tokens equal plain decoding's."""
    spec = {"algorithm": "eagle", "draft_model": DRAFT_MODELS["eagle"], "num_steps": K}
    eng = _tiny("emulate", spec, overlap_schedule=True, cuda_graph_max_batch_size=1)
    eng.spec.controller = Schedule([K, *[0] * 10])
    wrong, checked = _kept_hidden_checked(eng)
    kept_rows, kinds = eng.spec._kept_rows, []

    def recorded_kept_rows():
        kinds.append({type(h).__name__ for _, h in eng.spec._plain})
        return kept_rows()

    eng.spec._kept_rows = recorded_kept_rows
    sampling = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (60, 17)]
    outs = eng.generate(prompt_token_ids=PROMPTS, sampling=sampling)
    plain = _tiny(False).generate(prompt_token_ids=PROMPTS, sampling=sampling)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert not wrong, wrong
    assert {"int", "Tensor"} in kinds and len(checked) >= 4, (kinds, checked)
    eng.check_no_leak()


def test_the_hidden_ring_wraps_and_catches_up_before_it_is_full(monkeypatch):
    """A ring of 17 rows for 2 requests (`LAG_TOKENS` and `MAX_LAG` made small): long runs of
    overlapped plain steps wrap it many times, a step that would wrap starting at row 0, and
    the draft catches up whenever the next step might find too few free rows (before the lag
    bounds would: `SpecWorker._ring_full`). Every row a catch-up reads is its step's own (also
    across steps before and after the other request ended, where its row moved), and greedy
    tokens equal plain decoding's."""
    monkeypatch.setattr(worker_module, "LAG_TOKENS", 17)
    monkeypatch.setattr(worker_module, "MAX_LAG", 4)
    spec = {"algorithm": "eagle", "draft_model": DRAFT_MODELS["eagle"], "num_steps": K}
    eng = _tiny("emulate", spec, overlap_schedule=True)
    ring = eng.spec.ring
    assert ring.capacity == 17
    eng.spec.controller = Schedule([K, *[0] * 30])
    wrong, checked = _kept_hidden_checked(eng)
    taken, took = [], ring.take

    def recorded_take(rows):
        at = took(rows)
        taken.append((at, rows))
        return at

    ring.take = recorded_take
    # the first request ends first: the other's catch-ups then read runs of steps where its row moved
    sampling = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (45, 70)]
    outs = eng.generate(prompt_token_ids=PROMPTS, sampling=sampling)
    plain = _tiny(False).generate(prompt_token_ids=PROMPTS, sampling=sampling)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert not wrong, wrong
    assert ring.head > 6 * ring.capacity and eng.spec.catch_ups >= 6
    assert all(ring.row(at) + rows <= ring.capacity for at, rows in taken)  # no step wraps
    assert sum(ring.row(at) == 0 for at, _ in taken) >= 6
    eng.check_no_leak()


@pytest.mark.parametrize(
    "target, variant",
    [("gemma3", v) for v in ("standalone-swa", "eagle1-full", "eagle3-full")] + [("gemma4_moe", "standalone")],
)
def test_a_catch_up_runs_its_last_feed_forward_on_the_proposing_rows_alone(models, tmp_path, target, variant):
    """A catch-up reads only each proposing request's last row: its forward, pruned to those
    rows (`ForwardBatch.prune_to_logits`), runs the last layer's feed-forward on them alone and
    gives the logits and hidden states the same batch gives unpruned at those rows (forwarded
    again unpruned: its K and V writes are the same values). Gemma 4 with per-layer inputs and
    experts, a Gemma 3 draft (sandwich norms) and EAGLE-1/3 heads, after prefill and after plain
    steps; greedy output stays plain decoding's."""
    if target == "gemma4_moe":
        path = str(tmp_path / "gemma4")
        make_tiny_model("gemma4_moe", path)
        spec = {"algorithm": "standalone", "draft_model": make_perturbed_copy(path, str(tmp_path / "draft"), 0.05)}
    else:
        algorithm, pool, draft = SPEC_VARIANTS[variant]
        path = models[target]["target"]
        spec = {"algorithm": algorithm, "draft_model": models[target][draft], "draft_pool": pool}
    kwargs = dict(model=path, page_size=4, max_total_tokens=2048)
    prompts = random_prompts([2 * WINDOW + 3, WINDOW + 1], seed=5)
    sampling = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in Engine(**kwargs).generate(prompt_token_ids=prompts, sampling=sampling)]
    eng = Engine(**kwargs, speculative=spec | {"num_steps": K})
    eng.spec.controller = Schedule([K, 0, 0, 0, 0, 0])
    runner = eng.spec.drafter.runner
    model = runner.model
    last = model.midlayer if hasattr(model, "midlayer") else (getattr(model, "layers", None) or model.model.layers)[-1]
    mlp_rows = []
    last.mlp.register_forward_hook(lambda module, args, out: mlp_rows.append(args[0].shape[0]))
    forward, checked = runner.forward, []

    def compared(batch, pool=None):
        if not batch.prune_to_logits:
            return forward(batch, pool)
        full = forward(dataclasses.replace(batch, prune_to_logits=False), pool)
        rows_full = mlp_rows[-1]
        out = forward(batch, pool)
        kept = batch.logits_indices
        assert mlp_rows[-1] == kept.shape[0] < rows_full
        torch.testing.assert_close(out.logits, full.logits)
        torch.testing.assert_close(out.hidden, full.hidden.index_select(0, kept))
        checked.append((kept.shape[0], rows_full))
        return out

    runner.forward = compared
    assert [o.token_ids for o in eng.generate(prompt_token_ids=prompts, sampling=sampling)] == want
    assert len(checked) >= 3 and eng.spec.catch_ups >= 1, checked
    eng.check_no_leak()


@pytest.mark.parametrize("variant", ["standalone-swa", "eagle1-full", "frozen_kv_mtp-target"])
def test_a_draft_behind_by_more_than_its_window_catches_up_exactly(models, variant):
    """Plain steps put the draft WINDOW + 4 tokens behind before each round (its SWA window keeps
    the slots its catch-up reads: `Scheduler.window_from`), over a chunked prefill: every round's
    drafts equal those of a fresh engine that prefilled the same tokens at once, so the draft's
    state after catching up is exact (losslessness alone would not show it)."""
    m = models["gemma3"]
    algorithm, pool, draft = SPEC_VARIANTS[variant]
    spec = {"algorithm": algorithm, "draft_model": m[draft], "num_steps": K, "draft_pool": pool}
    eng = Engine(model=m["target"], page_size=4, chunked_prefill_size=5, max_total_tokens=4096, speculative=spec)
    eng.spec.controller, eng.spec.max_lag = Schedule([K, *[0] * (WINDOW + 4)]), 2 * WINDOW
    sampling = SamplingParams(max_new_tokens=3 * (WINDOW + 5), temperature=0.0, ignore_eos=True)
    for p in random_prompts([3 * WINDOW + 5, WINDOW + 3], seed=8):
        eng.add_request(p, sampling)
    rounds = []  # (tokens before the pending one, drafts)
    while eng.has_unfinished():
        before = {r.rid: r.tokens(0, r.num_tokens - 1) for r in eng.scheduler.running if r.prefilled}
        eng.step()
        rounds += [(before[rid], d) for rid, d in eng.last_step.drafts.items()]
    assert len(rounds) >= 4 and eng.spec.catch_ups >= 2
    fresh = Engine(model=m["target"], page_size=16, chunked_prefill_size=None, max_total_tokens=4096, speculative=spec)
    fresh.spec.controller = Schedule([K])
    for tokens, drafts in rounds[2:]:  # past the first round: each after a catch-up
        rid = fresh.add_request(tokens, SamplingParams(max_new_tokens=K + 2, temperature=0.0, ignore_eos=True))
        while not fresh.last_step.drafts:
            fresh.step()
        assert fresh.last_step.drafts[rid] == drafts
        fresh.abort(rid)
        fresh.step()
    eng.check_no_leak()


def test_the_adaptive_engine_records_its_choices_and_stays_lossless(models):
    """The adaptive controller itself in an engine (a CPU: nothing timed at start-up, each k
    measured by running it; measured times replaced by a fixed table, a round of k costing 1 + k
    plain steps, so that a busy test machine's noise decides nothing), with an EAGLE head that
    random weights make a poor draft: greedy output is plain decoding's, each decode step's
    record names its draft steps, the requests' records agree with them, and once each k is
    measured the steps are plain but for probes."""
    m = models["gemma3"]
    prompts = random_prompts([2 * WINDOW + 1, WINDOW + 3], seed=3)
    sampling = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    plain = Engine(model=m["target"], page_size=4, max_total_tokens=2048).generate(
        prompt_token_ids=prompts, sampling=sampling
    )
    eng = Engine(
        model=m["target"],
        page_size=4,
        max_total_tokens=2048,
        speculative={"algorithm": "eagle", "draft_model": m["eagle1"], "num_steps": K},
    )
    ctrl = eng.spec.controller
    assert isinstance(ctrl, AdaptiveDraftSteps) and not ctrl.costs.prior
    measure = ctrl.costs.observe
    ctrl.costs.observe = lambda batch_size, k, seconds: measure(batch_size, k, 1.0 + k)
    rids = [eng.add_request(p, sampling) for p in prompts]
    steps, plain_steps = [], collections.Counter()
    while eng.has_unfinished():
        eng.step()
        if eng.last_step.draft_steps is not None:
            steps.append(eng.last_step.draft_steps)
            assert bool(eng.last_step.accept_lengths) == (eng.last_step.draft_steps > 0)
            plain_steps.update(eng.last_step.request_ids if eng.last_step.draft_steps == 0 else [])
    outs = [eng.output(r) for r in rids]
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.spec.plain_steps for o in outs] == [plain_steps[r] for r in rids]
    for o in outs:
        assert o.spec.plain_steps + o.spec.verify_steps <= len(steps)
        assert sum(o.spec.accepted_per_position) == sum(n - 1 for n in o.spec.accept_lengths)
    explored = 4 * (K + 1)  # `dwell` steps at each k, K first
    assert steps[:explored] == [k for k in range(K, -1, -1) for _ in range(4)], steps
    assert steps[explored:].count(0) >= len(steps[explored:]) - 2, steps  # (probes at k = 1)
    eng.check_no_leak()


class _FixedTable(CostModel):
    """Measurements replaced by a fixed table (a round of k costs 1 + 2k plain steps), so that a
    busy test machine's noise decides nothing; the steps told, in turn."""

    def __init__(self, buckets, num_steps):
        super().__init__(buckets, num_steps)
        self.told = []

    def observe(self, batch_size, k, seconds):
        self.told.append((batch_size, k))
        super().observe(batch_size, k, 1.0 + 2 * k)

    def observe_all(self, batch_size, k, seconds):
        for each in seconds:
            self.observe(batch_size, k, each)


def test_an_engine_leasing_plain_steps_runs_the_steps_of_one_asking_every_step(plain_tokens):
    """EAGLE engines under emulated replay with overlapped plain steps (the hidden ring), their
    controllers' measurements a fixed table (plain steps the fastest), a request admitted while
    others decode and requests ending at different steps, the draft catching up every few plain
    steps: the engine whose controller leases plain steps ahead runs each step's draft length as
    one asked and told every step, both tell the cost model the same steps and end in the same
    controller state, greedy output is plain decoding's, and the leasing controller was not asked
    at half the plain steps or more."""
    spec = {"algorithm": "eagle", "draft_model": DRAFT_MODELS["eagle"], "num_steps": K}
    runs = {}
    for name, leases in (("leasing", True), ("asked", False)):
        eng = _tiny("emulate", spec, overlap_schedule=True, context_length=256, max_running_requests=3)
        costs = _FixedTable(eng.spec.controller.costs.buckets, K)
        ctrl = eng.spec.controller = AdaptiveDraftSteps(costs, leases=leases)
        told, chooses = ctrl.costs.told, []
        choose = ctrl.choose
        ctrl.choose = lambda *a, choose=choose, chooses=chooses: chooses.append(1) or choose(*a)
        eng.spec.max_lag = 32
        rids = [eng.add_request(p, dataclasses.replace(GREEDY, max_new_tokens=n)) for p, n in zip(PROMPTS, (200, 150))]
        steps = []
        while eng.has_unfinished():
            eng.step()
            steps.append(eng.last_step.draft_steps)
            if len(steps) == 70:
                late = eng.add_request(PROMPTS[0][::-1], dataclasses.replace(GREEDY, max_new_tokens=40))
        assert [eng.output(r).token_ids[:28] for r in rids] == plain_tokens
        assert eng.spec.catch_ups > 2 and eng.output(late).finish_reason == "length"
        eng.check_no_leak()
        ctrl.choose(1, lambda: _tokens(1, 0.5))  # (takes in what a lease holds)
        state = {n: v for n, v in _state(ctrl).items() if n not in ("choose", "_unsteady")}  # (these: real times)
        state["_unsteady"] = None if ctrl._unsteady is None else [(b, k) for b, k, _ in ctrl._unsteady]
        runs[name] = (steps, state, told, len(chooses))
    (steps, state, told, asks), asked = runs["leasing"], runs["asked"]
    assert steps == asked[0] and state == asked[1] and told == asked[2]
    plain = steps.count(0)
    assert plain > 60 and asks <= asked[3] - plain / 2, (asks, asked[3], plain)


def test_fixed_rounds_when_adaptive_is_off(models):
    m = models["gemma3"]
    spec = {"algorithm": "standalone", "draft_model": m["exact_copy"], "num_steps": K, "adaptive": False}
    eng = Engine(model=m["target"], page_size=4, max_total_tokens=2048, speculative=spec)
    (out,) = eng.generate(prompt_token_ids=random_prompts([11]), sampling=GREEDY)
    assert out.spec.draft_steps == [K] * out.spec.verify_steps and out.spec.plain_steps == 0
    assert set(out.spec.accept_lengths[:-1]) == {K + 1}
    with pytest.raises(ValueError, match="speculative.adaptive"):
        Engine(model=m["target"], max_total_tokens=256, speculative={**spec, "adaptive": "yes"})
