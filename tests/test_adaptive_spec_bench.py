"""`ops.bench.adaptive_spec` runs end to end (a CPU smoke run of its tiny part): every mode of a
draft, adaptive set against plain and the best fixed draft length, the table and the JSON."""

import json

import pytest

from ops.bench import adaptive_spec


def test_the_benchmark_compares_adaptive_with_plain_and_each_fixed_length(tmp_path, capsys):
    out = tmp_path / "adaptive.json"
    argv = ["--out", str(out), "--parts", "tiny", "--device", "cpu", "--batches", "1", "--new", "4"]
    adaptive_spec.main([*argv, "--prompt", "8", "--drafts", "frozen_kv_mtp", "--max-steps", "2"])
    results = json.loads(out.read_text())
    cases = {"tiny/b1/none/plain", *(f"tiny/b1/frozen_kv_mtp/{m}" for m in ("k1", "k2", "adaptive", "plain"))}
    assert set(results) == cases
    adaptive = results["tiny/b1/frozen_kv_mtp/adaptive"]
    # set against plain decoding timed beside it (not the plain engine's own, earlier case)
    best = max(r["tok_per_s"] for k, r in results.items() if not k.endswith("adaptive") and "/none/" not in k)
    assert adaptive["of_best"] == adaptive["tok_per_s"] / best
    assert adaptive["of_plain"] == adaptive["tok_per_s"] / results["tiny/b1/frozen_kv_mtp/plain"]["tok_per_s"]
    assert results["tiny/b1/frozen_kv_mtp/k2"]["draft_steps"] == 2.0
    assert "tiny/b1/frozen_kv_mtp/adaptive" in capsys.readouterr().out


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
    """Each round times plain decoding, adaptive and every fixed length once (after one warm-up
    round), so that a host drifting between runs moves them alike; every case is written to the
    output as its batch finishes."""
    from types import SimpleNamespace

    adaptive = object()
    engine = SimpleNamespace(spec=SimpleNamespace(num_steps=2, controller=adaptive))
    plain = SimpleNamespace(spec=None)
    order = []

    def fake_decode(each, prompts, new):
        mode = "plain" if each is plain else "adaptive" if each.spec.controller is adaptive else "fixed"
        order.append((mode, new))
        return {"tok_per_s": float(len(order))}

    monkeypatch.setattr(adaptive_spec, "decode", fake_decode)
    out = adaptive_spec.Results(str(tmp_path / "out.json"))
    adaptive_spec.run_modes("m", engine, "d", [4], lambda b: [[1]] * b, 64, out, plain)
    turn = ["plain", "adaptive", "fixed", "fixed"]
    assert [m for m, _ in order] == turn * (adaptive_spec.REPEATS + 1)
    assert [n for _, n in order] == [16] * 4 + [64] * 4 * adaptive_spec.REPEATS
    written = json.loads((tmp_path / "out.json").read_text())
    assert set(written) == {f"m/b4/d/{m}" for m in ("plain", "adaptive", "k1", "k2")}
    assert written["m/b4/d/adaptive"]["of_plain"] == pytest.approx(
        written["m/b4/d/adaptive"]["tok_per_s"] / written["m/b4/d/plain"]["tok_per_s"]
    )
