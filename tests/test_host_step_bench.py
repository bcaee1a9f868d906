"""`ops/bench/host_step.py`: decode steps on the CPU's emulated graphs with the device's work
taken out (the model does not run after each graph's first replay), a draft engine held at plain
steps beside plain decoding."""

from ops.bench import host_step
from ops.bench.decode_throughput import timed_decode


def test_the_model_runs_only_for_each_graphs_first_replay_once_taken_out():
    engine = host_step.build(1, None)
    host_step.step_us(engine, 1, 4)
    calls = []
    model_forward = engine.runner.model.forward
    engine.runner.model.forward = lambda batch: calls.append(batch.forward_mode) or model_forward(batch)
    with host_step.device_work_taken_out():
        steps = host_step.step_us(engine, 1, 12)
    decodes = [mode for mode in calls if mode.name != "EXTEND"]  # (the prefill runs eagerly)
    assert len(steps) >= 10 and len(decodes) <= 1  # the graph's first replay in the context, at most
    engine.check_no_leak()


def test_a_draft_engine_stays_at_plain_steps_and_is_set_against_plain_decoding():
    cases = host_step.measure(1, ["eagle"], new=12, repeats=2)
    assert set(cases) == {"b1/plain", "b1/eagle"}
    eagle = cases["b1/eagle"]
    assert eagle["draft_steps"] == 0 and eagle["steps"] == cases["b1/plain"]["steps"] == 2 * (12 - 2)
    assert eagle["calls_over_plain"] > 0  # the speculative worker's and controller's bookkeeping


def test_a_draft_engines_step_is_set_against_plain_decodings_step_of_the_same_turn():
    """A host that slows down over a round and between rounds: each turn's difference stays 5 us,
    which the difference of the medians misses."""
    rounds = [
        {"plain": [100.0, 200.0, 300.0], "eagle": [105.0, 205.0, 305.0]},
        {"plain": [1000.0, 1000.0, 1000.0], "eagle": [1005.0, 1005.0, 1005.0]},
        {"plain": [90.0, 90.0], "eagle": [95.0, 95.0, 90.0]},  # (a step more: left unpaired)
    ]
    cases = host_step.set_against_plain(rounds)
    assert cases["eagle"]["over_plain_us"] == 5.0 and cases["eagle"]["steps"] == 9
    assert cases["plain"]["p50_us"] == 250.0 and cases["eagle"]["p50_us"] == 205.0


def test_a_draft_engine_runs_no_round_from_its_first_step():
    """Its rounds are priced, not timed: a first round would price them from its own time."""
    engine = host_step.build(1, "frozen_kv_mtp")
    drafted = []
    sampling = host_step.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    timed_decode(engine, host_step.prompts(1), sampling, lambda: drafted.append(engine.last_step.draft_steps))
    assert len(drafted) >= 10 and set(drafted) - {None} == {0}  # (None: the drain, launching nothing)
    engine.shutdown()


def test_the_mean_difference_holds_the_rare_dear_step_the_median_leaves_out():
    """One step in nine decides (90 us more): the median difference misses it, the mean, which
    throughput sees, holds it."""
    cases = host_step.set_against_plain([{"plain": [100.0] * 9, "eagle": [105.0] * 8 + [195.0]}])
    assert cases["eagle"]["over_plain_us"] == 5.0 and cases["eagle"]["over_plain_mean_us"] == 15.0
    assert cases["eagle"]["mean_us"] == 115.0 and cases["plain"]["mean_us"] == 100.0


def test_rounds_of_a_fixed_draft_length_are_timed_as_the_draft_engines_steps():
    cases = host_step.measure(1, ["eagle"], new=8, repeats=1, round_steps=2)
    assert set(cases) == {"b1/plain", "b1/eagle/k2"} and cases["b1/eagle/k2"]["draft_steps"] == 2
    assert cases["b1/eagle/k2"]["calls"] > 2 * cases["b1/plain"]["calls"]  # a chain, a verify, a catch-up a round
