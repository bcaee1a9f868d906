"""Overlapped decoding (`workers/overlap.py`) gives the tokens of step-by-step decoding: with and
without (emulated) CUDA graphs, with stop tokens that end requests at unforeseeable steps, length
limits, an abort in the middle and requests arriving while the pipeline runs; every pool is back
at its free count and every request is reported finished exactly once."""

import collections

import pytest

from tests.hf_models import make_tiny_model, random_prompts
from workers.cuda_graphs import CudaGraphRunner
from workers.engine import Engine, SamplingParams
from workers.forward_batch import ForwardBatch

PROMPTS = random_prompts([23, 9, 41, 5, 17, 30], seed=11)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("overlap") / "gemma3")
    make_tiny_model("gemma3", path)
    return path


def _engine(model, overlap: bool, graphs=False) -> Engine:
    return Engine(
        model=model,
        page_size=4,
        attention_backend="trtllm_mha",
        max_total_tokens=4096,
        chunked_prefill_size=16,
        context_length=256,
        max_running_requests=8,
        cuda_graphs=graphs,
        overlap_schedule=overlap,
    )


def _params(i: int, stop: list[int]) -> SamplingParams:
    return SamplingParams(max_new_tokens=8 + 5 * i, temperature=0.0, stop_token_ids=tuple(stop))


def _run(engine: Engine, stops: list[int], abort_at: int | None = None, late: int = 0):
    """Stream PROMPTS (the last `late` of them arriving mid-way), collecting events per request
    and, per step, whether the engine left the next step running on the device."""
    tokens, finished, in_flight = collections.defaultdict(list), collections.Counter(), []
    rids = [engine.add_request(p, _params(i, stops)) for i, p in enumerate(PROMPTS[: len(PROMPTS) - late])]
    step = 0
    while engine.has_unfinished():
        for rid, new, done in engine.step():
            tokens[rid] += new
            finished[rid] += done
        in_flight.append(engine.step_in_flight)
        step += 1
        if step == 6 and late:
            rids += [engine.add_request(p, _params(len(rids) + j, stops)) for j, p in enumerate(PROMPTS[-late:])]
        if abort_at is not None and step == abort_at:
            engine.abort(rids[0])
            finished[rids[0]] += 1
    engine.check_no_leak()
    return [tokens[r] for r in rids], [finished[r] for r in rids], in_flight


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_overlapped_decoding_gives_the_step_by_step_tokens(model, graphs):
    reference = _engine(model, False).generate(prompt_token_ids=PROMPTS, sampling=[_params(i, []) for i in range(6)])
    common = collections.Counter(t for o in reference for t in o.token_ids[2:6])
    stops = [t for t, _ in common.most_common(2)]  # tokens that do come up: requests stop mid-way
    expected, _, eager_in_flight = _run(_engine(model, False, graphs), stops)
    got, finished, in_flight = _run(_engine(model, True, graphs), stops)
    assert got == expected
    assert not any(eager_in_flight) and any(in_flight) and not in_flight[-1]  # what the hand-over wait reads on GPU
    assert finished == [1] * len(PROMPTS)
    assert any(len(t) < 8 + 5 * i for i, t in enumerate(got)), "a stop token should end some request early"


def test_graph_steps_read_the_last_steps_tokens_in_place(model, monkeypatch):
    """An overlapped step replaying the greedy decode graph takes its ids straight from the
    tokens the step before left in the graph's static buffer (reordered when a request left),
    never through a copy; its tokens are the step-by-step engine's."""
    reads = []
    original = CudaGraphRunner._in_tokens

    def spy(self, ids):
        reads.append(original(self, ids))
        return reads[-1]

    monkeypatch.setattr(CudaGraphRunner, "_in_tokens", spy)
    reordered = []
    use = ForwardBatch.use_device_ids
    monkeypatch.setattr(
        ForwardBatch,
        "use_device_ids",
        lambda b, ids, rows=None: reordered.append(rows is not None) or use(b, ids, rows),
    )
    expected, _, _ = _run(_engine(model, False), [])
    got, _, _ = _run(_engine(model, True, "emulate"), [])
    assert got == expected
    assert reads and all(reads), "device ids of a greedy decode step should be the graph's own tokens"
    assert any(reordered) and not all(reordered)


def test_arrivals_and_aborts_while_the_pipeline_runs(model):
    expected, _, _ = _run(_engine(model, False), [], abort_at=9, late=2)
    got, finished, _ = _run(_engine(model, True), [], abort_at=9, late=2)
    assert got[1:] == expected[1:]  # the aborted request's tokens depend on when the abort lands
    assert finished == [1] * len(PROMPTS)


def test_the_host_may_pause_between_steps_on_cpu(model):
    """On CPU the host is the device: the rank actor's hand-over wait only hands the interpreter
    lock to the thread sending the tokens, so it stays on whether or not a step is in flight."""
    engine = _engine(model, False)
    assert not engine.step_in_flight and engine.host_can_pause
