"""decode_step's --against: the other revision's processes really import that revision."""

import os
import subprocess

from ops.bench.decode_step import tree_process

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_other_tree_shadows_this_one(tmp_path):
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "__init__.py").write_text("import sys\nprint('other tree')\nsys.exit(3)\n")
    cmd, env = tree_process(str(tmp_path), HERE, ["--help"])
    done = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (3, "other tree"), done.stderr[-2000:]


def test_this_tree_runs_its_own_packages():
    cmd, env = tree_process(HERE, HERE, ["--help"])
    done = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--against" in done.stdout, done.stderr[-2000:]


def test_starved_counts_the_steps_that_found_the_device_idle(monkeypatch):
    """A step counts when the event recorded after the step before has completed by the time
    the host comes back (the device ran out of work); the first step has no step before it."""
    import torch

    from ops.bench import decode_step

    answers = iter([True, False, True, True])  # steps 2..5: idle, busy, idle, idle

    class Event:
        def record(self):
            pass

        def query(self):
            return next(answers)

    class Engine:
        steps = 0

        def step(self):
            Engine.steps += 1

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    timed = decode_step.timed_steps(Engine(), 5)
    assert Engine.steps == 5 and timed.starved == 3 / 4 and timed.seconds >= 0


def test_the_replay_clock_times_graphs_and_the_device_time_between_them(monkeypatch):
    """Events around each replay: the median replay's own time, and the median time from one
    replay's end to the next one's start; replays outside `running` are not timed."""
    import torch

    from ops.bench import decode_step

    class Event:  # device times in ms, in the order the events are recorded
        clock = iter([0.0, 0.9, 1.0, 1.95, 2.0, 2.9])

        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.t = next(Event.clock)

        def elapsed_time(self, other):
            return other.t - self.t

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    clock = decode_step.ReplayClock()
    with clock.running():
        for _ in range(3):
            Graph().replay()
    Graph().replay()
    assert Graph.replays == 4 and len(clock.marks) == 3
    inside, between = clock.medians()
    assert abs(inside - 0.9) < 1e-9 and abs(between - 75.0) < 1e-6  # replays 0.9, 0.95, 0.9; gaps 0.1, 0.05 ms
