"""Adaptive draft length on the GPU, CUDA graphs on (docs/design.md §6.1): the shipped tiny
target with each of its drafts, the draft length forced through every k and runs of plain steps,
gives plain decoding's logits within bf16 noise up to any first divergence (which only a near
tie may cause), with and without the host reading logits (without: plain steps overlapped,
verifies launched ahead); start-up times every captured batch size and k; a plain step of a
speculative engine reads the device once, as plain decoding's; the hidden states an EAGLE head
catches up from are each plain step's own, as the captured decode graph wrote them to its ring."""

import pytest

from ops import DEFAULT_MODEL, DRAFT_MODELS
from tests.workers.test_adaptive_spec import SCHEDULE, Schedule, _kept_hidden_checked
from tests.workers.test_gpu_engine import compare_bf16_runs
from workers.engine import Engine, SamplingParams
from workers.speculative import worker as worker_module
from workers.speculative.controller import AdaptiveDraftSteps

pytestmark = pytest.mark.gpu
K = 3
NEAR_TIE = 2**-5  # of the largest logit: a first divergence with a smaller top-2 gap is bf16 noise


def _prompts() -> list[list[int]]:
    import json

    from workers.tokenizer import load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    text = open(json.decoder.__file__).read()
    return [tok.encode(text[i * 900 :])[:96] for i in range(6)]


def _engine(spec: dict | None) -> Engine:
    return Engine(
        model=DEFAULT_MODEL,
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        max_total_tokens=8192,
        max_running_requests=8,
        speculative=spec,
    )


@pytest.fixture(scope="module")
def plain():
    sampling = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True, return_logits=True)
    return _engine(None).generate(prompt_token_ids=_prompts(), sampling=sampling)


@pytest.mark.parametrize("algorithm", sorted(DRAFT_MODELS))
def test_forced_switches_under_graph_replay_stay_within_bf16_noise(plain, algorithm):
    spec = {"algorithm": algorithm, "draft_model": DRAFT_MODELS[algorithm], "num_steps": K}
    eng = _engine(spec)
    assert eng.runner.graphs is not None
    for reads_logits in (True, False):
        eng.spec.controller, eng.spec.max_lag = Schedule(SCHEDULE), 4
        sampling = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True, return_logits=reads_logits)
        outs = eng.generate(prompt_token_ids=_prompts(), sampling=sampling)
        assert {k for o in outs for k in o.spec.draft_steps} == {1, 2, K} and all(o.spec.plain_steps for o in outs)
        if reads_logits:
            diverged, worst = compare_bf16_runs(plain, outs, f"{algorithm} adaptive")
            print(f"{algorithm}: {diverged} diverged, largest logit difference {worst:.3g}")
            continue
        for ref, out in zip(plain, outs):  # no logits here: a divergence must sit at a near tie of plain's
            first = next((i for i, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b), None)
            if first is not None:
                top2 = ref.logits[first].float().topk(2).values
                assert (top2[0] - top2[1]) / top2.abs().max() < NEAR_TIE, f"{algorithm}: diverged at {first}"
    eng.check_no_leak()


def test_start_up_times_every_batch_size_and_draft_length():
    spec = {"algorithm": "eagle", "draft_model": DRAFT_MODELS["eagle"], "num_steps": K}
    eng = _engine(spec)
    ctrl = eng.spec.controller
    assert isinstance(ctrl, AdaptiveDraftSteps)
    sizes = eng.runner.graphs.batch_sizes
    assert set(ctrl.costs.prior) == {(b, k) for b in sizes for k in range(K + 1)}
    assert all(0 < s < 1 for s in ctrl.costs.prior.values())
    for b in sizes:  # a round of more drafts replays more
        assert ctrl.costs.prior[(b, 0)] < ctrl.costs.prior[(b, K)], ctrl.costs.prior
    print({k: f"{1e3 * s:.3f} ms" for k, s in sorted(ctrl.costs.prior.items())})


@pytest.mark.parametrize("algorithm", sorted(DRAFT_MODELS))
def test_a_plain_step_of_a_speculative_engine_reads_the_device_once(algorithm):
    from ops.bench.decode_throughput import sync_sites

    spec = {"algorithm": algorithm, "draft_model": DRAFT_MODELS[algorithm], "num_steps": K}
    eng = _engine(spec)
    eng.spec.controller = Schedule([0])
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    for p in _prompts()[:3]:
        eng.add_request(p, sampling)
    while any(not r.prefilled for r in eng.scheduler.running):
        eng.step()
    eng.step()
    steps = 8
    sites = sync_sites(eng, steps)
    assert sum(sites.values()) <= steps, f"{algorithm}: host syncs per plain step {sites}"
    assert eng.step_in_flight  # overlapped
    while eng.has_unfinished():
        eng.step()
    eng.check_no_leak()


def test_an_eagle_heads_catch_up_reads_each_plain_steps_own_hidden_states_from_the_graphs_ring(monkeypatch):
    """Overlapped plain steps under real replay write their target hidden states into the hidden
    ring from inside the captured graph (`workers/hidden_ring.py`): every row a catch-up reads is
    bit for bit the state its own step's forward produced, the ring wrapping meanwhile."""
    monkeypatch.setattr(worker_module, "LAG_TOKENS", 17 * 8)  # a ring of 17 full steps' rows
    monkeypatch.setattr(worker_module, "MAX_LAG", 4)
    spec = {"algorithm": "eagle", "draft_model": DRAFT_MODELS["eagle"], "num_steps": K}
    eng = _engine(spec)
    ring = eng.spec.ring
    assert ring is not None and ring.capacity == 17 * 8 and eng.runner.graphs is not None
    eng.spec.controller, eng.spec.max_lag = Schedule([K, *[0] * 12]), 12
    wrong, checked = _kept_hidden_checked(eng)
    sampling = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompt_token_ids=_prompts(), sampling=sampling)
    assert not wrong, wrong[:8]
    assert len(checked) >= 6 and ring.head > ring.capacity and all(o.spec.plain_steps for o in outs)
    eng.check_no_leak()
