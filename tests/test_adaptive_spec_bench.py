"""`ops.bench.adaptive_spec` runs end to end (a CPU smoke run of its tiny part): every mode of a
draft, adaptive set against plain and the best fixed draft length, the table and the JSON."""

import json
import os
import statistics

import pytest
import torch

from ops.bench import adaptive_spec


def test_the_benchmark_compares_adaptive_with_plain_and_each_fixed_length(tmp_path, capsys):
    out = tmp_path / "adaptive.json"
    argv = ["--out", str(out), "--parts", "tiny", "--device", "cpu", "--batches", "1", "--new", "4"]
    adaptive_spec.main([*argv, "--prompt", "8", "--drafts", "frozen_kv_mtp", "--max-steps", "2"])
    results = json.loads(out.read_text())
    modes = ("k1", "k2", "adaptive", "plain", "control")
    assert set(results) == {"tiny/b1/none/plain", *(f"tiny/b1/frozen_kv_mtp/{m}" for m in modes)}
    adaptive = results["tiny/b1/frozen_kv_mtp/adaptive"]
    # set against plain decoding and each fixed length timed in the same round (not the plain
    # engine's own, earlier case), the median over rounds; the control against plain alike
    rounds = {k.rsplit("/", 1)[1]: r["tok_per_s_runs"] for k, r in results.items() if "/none/" not in k}
    assert {len(runs) for runs in rounds.values()} == {adaptive_spec.REPEATS}
    control = rounds.pop("control")
    assert adaptive["control_of_plain"] == pytest.approx(
        statistics.median(c / p for c, p in zip(control, rounds["plain"]))
    )
    mine = rounds.pop("adaptive")
    against = [statistics.median(a / b for a, b in zip(mine, other)) for other in rounds.values()]
    assert adaptive["of_best"] == pytest.approx(min(against))
    assert adaptive["of_plain"] == pytest.approx(statistics.median(a / b for a, b in zip(mine, rounds["plain"])))
    assert results["tiny/b1/frozen_kv_mtp/k2"]["draft_steps"] == 2.0
    assert len(adaptive["switches_runs"]) == len(adaptive["catch_ups_runs"]) == adaptive_spec.REPEATS
    assert "switches_runs" not in results["tiny/b1/none/plain"]  # (no draft: nothing changes)
    assert "tiny/b1/frozen_kv_mtp/adaptive" in capsys.readouterr().out


def test_adaptive_is_set_against_the_runs_of_its_own_rounds():
    """A host twice as fast in some rounds as in others: per round, adaptive is at 96% of plain
    decoding (ahead of every fixed length), which the ratio of the cases' median runs misses;
    cases whose rounds do not pair up are set against each other's median runs."""
    fast, slow = 2000.0, 1000.0
    plain = [fast, slow, fast, slow, slow]
    results = {
        "m/b1/d/plain": {"tok_per_s": slow, "tok_per_s_runs": plain},
        "m/b1/d/adaptive": {"tok_per_s": 0.96 * fast, "tok_per_s_runs": [0.96 * p for p in plain]},
        "m/b1/d/k1": {"tok_per_s": 500.0, "tok_per_s_runs": [0.5 * p for p in plain]},
        "m/b1/e/plain": {"tok_per_s": 1000.0},
        "m/b1/e/adaptive": {"tok_per_s": 900.0, "tok_per_s_runs": [900.0] * 5},
    }
    adaptive_spec.compare(results)
    assert results["m/b1/d/adaptive"]["of_best"] == pytest.approx(0.96)
    assert results["m/b1/d/adaptive"]["of_plain"] == pytest.approx(0.96)
    assert results["m/b1/e/adaptive"]["of_best"] == pytest.approx(0.9)


def test_adaptive_is_set_against_the_best_mode_not_the_luckiest_run_of_each_round():
    """Adaptive equal to plain decoding in every round, and four fixed lengths at 80% of it but
    each lucky once (110%) in a round of its own: against the best mode, plain, adaptive is at
    100%; a per-round maximum would take a lucky fixed run four rounds in five (91%)."""
    plain = [1000.0] * 5
    results = {"m/b1/d/plain": {"tok_per_s": 1000.0, "tok_per_s_runs": plain}}
    results["m/b1/d/adaptive"] = {"tok_per_s": 1000.0, "tok_per_s_runs": list(plain)}
    for k in range(1, 5):
        runs = [1100.0 if i == k - 1 else 800.0 for i in range(5)]
        results[f"m/b1/d/k{k}"] = {"tok_per_s": 800.0, "tok_per_s_runs": runs}
    adaptive_spec.compare(results)
    assert results["m/b1/d/adaptive"]["of_best"] == pytest.approx(1.0)


def test_the_time_split_sets_the_median_plain_step_beside_the_mean():
    """Four plain steps of 1 ms, one holding a 9 ms catch-up, a round of 5 ms and the drain of the
    overlapped steps: the mean plain step carries the catch-up, the median does not."""
    ms = 1_000_000
    steps = [(0, 1 * ms), (0, 2 * ms), (0, 12 * ms), (0, 13 * ms), (3, 18 * ms), (None, 19 * ms)]
    split = adaptive_spec.time_split(steps, 0)
    assert split["plain_ms"] == pytest.approx(14 / 4) and split["plain_p50_ms"] == pytest.approx(1.0)
    assert split["round_ms"] == pytest.approx(5.0) and split["switches"] == 1
    quantiles = adaptive_spec.step_quantiles(steps, 0)  # every step: 1, 1, 10, 1, 5, 1 ms
    assert quantiles["step_p50_ms"] == pytest.approx(1.0) and quantiles["step_p90_ms"] > 5.0


def test_every_mode_of_a_batch_is_timed_in_turn_beside_plain_decoding(tmp_path, monkeypatch):
    """Each round times the control, plain decoding, adaptive and every fixed length once (after
    one warm-up round), adaptive and the control each right beside plain, so that a host drifting
    between runs moves them alike; every case is written to the output as its batch finishes."""
    from types import SimpleNamespace

    adaptive = object()
    engine = SimpleNamespace(spec=SimpleNamespace(num_steps=2, controller=adaptive))
    plain, control = SimpleNamespace(spec=None), SimpleNamespace(spec=None)
    order = []

    def fake_decode(each, prompts, new):
        if each.spec is None:
            mode = "plain" if each is plain else "control"
        else:
            mode = "adaptive" if each.spec.controller is adaptive else "fixed"
        order.append((mode, new))
        return {"tok_per_s": float(len(order))}

    monkeypatch.setattr(adaptive_spec, "decode", fake_decode)
    out = adaptive_spec.Results(str(tmp_path / "out.json"))
    adaptive_spec.run_modes("m", engine, "d", [4], lambda b: [[1]] * b, 64, out, plain, control=control)
    turn = ["control", "plain", "adaptive", "fixed", "fixed"]
    rounds = [order[i : i + 5] for i in range(0, len(order), 5)]
    assert [[m for m, _ in r] for r in rounds] == [turn if i % 2 == 0 else turn[::-1] for i in range(len(rounds))]
    assert len(rounds) == adaptive_spec.REPEATS + 1
    assert [n for _, n in order] == [16] * 5 + [64] * 5 * adaptive_spec.REPEATS
    written = json.loads((tmp_path / "out.json").read_text())
    assert set(written) == {f"m/b4/d/{m}" for m in ("plain", "adaptive", "k1", "k2", "control")}
    adaptive, plain = written["m/b4/d/adaptive"]["tok_per_s_runs"], written["m/b4/d/plain"]["tok_per_s_runs"]
    assert written["m/b4/d/adaptive"]["of_plain"] == pytest.approx(
        statistics.median(a / p for a, p in zip(adaptive, plain))
    )


def test_the_process_is_pinned_to_the_cpu_asked_for_and_a_cpu_it_may_not_use_is_refused():
    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        adaptive_spec.pin_cpu(max(allowed))
        assert os.sched_getaffinity(0) == {max(allowed)}
        assert torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="--pin-cpu: .* this process may run on CPUs"):
        adaptive_spec.pin_cpu(max(allowed) + 1000)
    assert os.sched_getaffinity(0) == allowed
