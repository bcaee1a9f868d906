"""`ops/bench/settle_steps.py`: decode steps by their place after a change between plain steps and
rounds, under a scripted controller."""

import argparse
import random
import types

import pytest

from ops.bench import host_step, settle_steps
from ops.bench.decode_throughput import timed_decode
from workers.engine import SamplingParams


def test_steps_are_placed_after_the_last_change_of_kind():
    """Ends 1 ms apart but where noted: the first stretch and each first step after a change are
    left out, a drain (None) has no place and does not end a stretch."""
    ks = [0, 0, 0, None, 4, 4, 4, 0, 0, 0, 0, None, 2, 2]
    ends, t = [], 0
    for i in range(len(ks)):
        t += 3_000_000 if i in (5, 9) else 1_000_000  # (a slow second round, a slow third plain step)
        ends.append(t)
    plain, rounds = settle_steps.places(list(zip(ks, ends)))
    assert plain == {2: [1000.0], 3: [3000.0], 4: [1000.0]}
    assert rounds == {2: [3000.0, 1000.0], 3: [1000.0]}


def test_bands_are_medians_set_against_the_steady_last():
    by_place = {2: [300.0], 3: [200.0, 250.0], 6: [150.0], 40: [100.0, 100.0, 120.0]}
    band_us = settle_steps.bands(by_place, settle_steps.PLAIN_BANDS)
    assert band_us == {"2-4": 250.0, "5-8": 150.0, "33-on": 100.0}
    assert settle_steps.over_steady(band_us) == {"2-4": 2.5, "5-8": 1.5, "33-on": 1.0}
    assert settle_steps.over_steady({}) == {}
    assert settle_steps.COLUMNS[0] == "plain_over_steady/2-4" and "round_over_steady/2" in settle_steps.COLUMNS


def test_held_plain_steps_leave_out_the_first_and_what_decoded_nothing():
    steps = [(None, 0), (0, 1_000), (0, 3_000), (None, 4_000), (0, 4_500), (0, 5_000)]
    assert settle_steps.held_plain_us(steps) == [2.0, 0.5, 0.5]


class _Clock:
    ns = 0

    def perf_counter_ns(self) -> int:
        return self.ns


class _Engine:
    """Decodes `steps` plain steps, each advancing the shared clock by `ns`."""

    def __init__(self, clock: _Clock, ns: int, steps: int) -> None:
        self.clock, self.ns, self.left = clock, ns, steps
        self.scheduler = types.SimpleNamespace(running=[], waiting=[])
        self.last_step = types.SimpleNamespace(draft_steps=None)
        self.released: list[str] = []

    def add_request(self, prompt, sampling) -> str:
        return f"r{len(prompt)}"

    def has_unfinished(self) -> bool:
        return self.left > 0

    def step(self) -> None:
        self.clock.ns += self.ns
        self.left -= 1
        self.last_step.draft_steps = 0

    def release(self, rid: str) -> None:
        self.released.append(rid)


def test_engines_stepped_in_turns_are_each_timed_by_their_own_calls(monkeypatch):
    """Another engine's step between two of an engine's own is not counted."""
    clock = _Clock()
    monkeypatch.setattr(host_step, "time", clock)
    engines = {"fast": _Engine(clock, 1_000, 6), "slow": _Engine(clock, 7_000, 4)}
    steps = settle_steps.interleaved(engines, [[1, 2], [3]], None, random.Random(0))
    assert steps["fast"] == [(0, 1_000 * i) for i in range(1, 7)]
    assert steps["slow"] == [(0, 7_000 * i) for i in range(1, 5)]
    assert engines["fast"].released == engines["slow"].released == ["r2", "r1"]


def test_the_scripted_controller_alternates_rounds_and_plain_steps(capsys):
    draft = "frozen_kv_mtp"
    engine = host_step.build(1, draft, 3, "cpu")
    engine.spec.controller = settle_steps.AlternatingDraftSteps(rounds=2, plain=5, k=3)
    steps = []
    sampling = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    timed_decode(engine, [[5, 6, 7, 8] * 8], sampling, lambda: steps.append(engine.last_step.draft_steps))
    engine.check_no_leak()
    engine.shutdown()
    decoded = [k for k in steps if k is not None]
    assert decoded[:10] == [3, 3] + [0] * 6 + [3, 3], steps  # (plain: the launch, not told, and 5 told)
    args = argparse.Namespace(device="cpu", rounds=2, plain=6, k=3, new=30, repeats=1)
    case = settle_steps.measure(draft, 1, args)
    assert case["plain_steps"] > 0 and case["rounds"] > 0 and list(case["round_us"]) == ["2"]
    assert case["plain_over_steady"][list(case["plain_us"])[-1]] == 1.0
    assert case["held_us"] > 0 and list(case["plain_over_held"]) == list(case["plain_us"])
    band, us = next(iter(case["plain_us"].items()))
    assert case["plain_over_held"][band] == pytest.approx(us / case["held_us"])
    with pytest.raises(SystemExit):
        settle_steps.main(["--new", str(host_step.TOKENS_A_REQUEST)])
    assert f"--new: {host_step.TOKENS_A_REQUEST}, but a request holds 1 to" in capsys.readouterr().err
