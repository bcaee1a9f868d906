"""The draft steps the controller chose, as an operator sees them: each step span records them,
`spec_decode_num_draft_steps` counts decode steps by them, and `slidespec diagnose` tells an
accept-length drop the drafts caused (the text) from one the controller's choice caused. Step
records go through the real tracer and file exporter (engines are not needed: what a step
records is `tests/workers/test_adaptive_spec.py`'s)."""

import random

from cluster.config import TracingArgs
from cluster.metrics import ServingMetrics
from cluster.tracing import _PROVIDERS, flush_all, record_step, tracer_for
from ops.diagnose import diagnose, draft_step_counts, load_spans
from workers.step_record import StepRecord

K = 3
INFO = {"attention_backend": "trtllm_mha", "max_window": 64, "speculative": "eagle", "draft_pool": "full"}
KV = {"full_total": 100, "full_free": 50, "swa_total": 100, "swa_free": 50}


def _accept_length(rng: random.Random, k: int, rate: float) -> int:
    """A round of k drafts each accepted with `rate` given the ones before: accepted + 1."""
    n = 0
    while n < k and rng.random() < rate:
        n += 1
    return n + 1


def _trace(tmp_path, phases: list[tuple[int, float, int]]) -> str:
    """Step spans of four requests over `phases` of (draft steps, acceptance rate per position,
    steps); after every rounded step two plain steps (k = 0, nothing verified)."""
    _PROVIDERS.clear()
    trace_dir = str(tmp_path / "traces")
    tracer = tracer_for(TracingArgs(exporter="file", file_dir=trace_dir), "rank0")
    rng, t, rids = random.Random(0), 1_000_000_000, [f"r{i}" for i in range(4)]
    for k, rate, steps in phases:
        for _ in range(steps):
            for drafts in (k, 0, 0):
                lengths = {r: _accept_length(rng, drafts, rate) for r in rids} if drafts else {}
                step = StepRecord(request_ids=rids, seq_lens=[100] * 4, cached_tokens=[0] * 4, start_ns=t)
                step.accept_lengths, step.draft_steps, step.end_ns = lengths, drafts, t + 1000
                record_step(tracer, step, [None] * 4, INFO, KV, K)
                t += 10_000
    flush_all()
    _PROVIDERS.clear()
    return trace_dir


def test_a_drop_from_the_controllers_choice(tmp_path):
    """Acceptance 0.8 at every position throughout; the controller goes from 3 draft steps to
    1: accept length falls, and the report says the controller did it."""
    trace_dir = _trace(tmp_path, [(K, 0.8, 40), (1, 0.8, 40)])
    assert draft_step_counts(load_spans([trace_dir])) == {0: 160, 1: 40, K: 40}
    text, drop = diagnose([trace_dir])
    print(text)
    assert drop is not None and drop.after < drop.before
    assert "slidespec.spec.draft_steps: 3 -> 1" in text
    assert "cause: the draft-length controller: 3.00 -> 1.00 draft steps a round" in text
    assert "decode steps by draft steps (0: plain): 0: 160, 1: 40, 3: 40" in text


def test_a_drop_from_the_text(tmp_path):
    """The same draft steps throughout, acceptance falls from 0.9 to 0.3 (the text turned hard
    to draft); then the controller follows with fewer steps: still the drafts' doing."""
    for phases in ([(K, 0.9, 40), (K, 0.3, 40)], [(K, 0.9, 40), (1, 0.3, 40)]):
        trace_dir = _trace(tmp_path / str(len(phases[1:]) + phases[1][0]), phases)
        text, drop = diagnose([trace_dir])
        print(text)
        assert drop is not None and "cause: the drafts: acceptance fell (position 1: 0.9" in text


def test_metrics_count_decode_steps_by_draft_steps():
    metrics = ServingMetrics("tiny")
    spec = {
        "verify_steps": 3,
        "accept_lengths": [4, 2, 1],
        "accepted_per_position": [2, 1, 1],
        "mean_accept_length": 7 / 3,
        "draft_steps": [3, 1, 3],
        "plain_steps": 5,
    }
    metrics.finished({"spec": spec, "completion_tokens": 12}, 1.0, 0.5)
    text = metrics.exposition()[0].decode()
    for k, n in ((0, 5), (1, 1), (K, 2)):
        assert f'slidespec_spec_decode_num_draft_steps_total{{draft_steps="{k}",model_name="tiny"}} {n}.0' in text
    assert 'slidespec_spec_decode_num_draft_tokens_total{model_name="tiny"} 7.0' in text  # 3 + 1 + 3 proposed
    assert f'slidespec_spec_accept_rate{{model_name="tiny"}} {4 / 7}' in text
