"""`slidespec diagnose` on real traces: engine steps recorded through OpenTelemetry's OTLP
JSON-lines file exporter. A healthy run (a copy of the target as draft, SWA then full-only draft
pool) shows no drop; putting back the upstream mistake of invariant 1 (docs/design.md §4.1) for the
full-only pool makes accept length drop there, and the report names the draft pool attribute that
changed. Accept length is broken down by prefix-cache hit."""

import os

import pytest
import torch

from attention.trtllm_mha import TRTLLMMHABackend
from cluster.config import TracingArgs
from cluster.tracing import _PROVIDERS, engine_info, flush_all, record_step, tracer_for
from ops.diagnose import breakdowns, diagnose, load_spans, step_points
from tests.draft_models import make_target_and_draft
from tests.workers.test_speculative import _UpstreamReadsByAllocator
from workers.engine import Engine, SamplingParams
from workers.scheduler import Scheduler

K = 3
FIXED = {"adaptive": False}  # rounds of K drafts every step


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_target_and_draft(tmp_path_factory.mktemp("diag"))


def _engine(target: str, draft: str, pool: str) -> Engine:
    return Engine(
        model=target,
        page_size=4,
        attention_backend="trtllm_mha",
        chunked_prefill_size=16,
        max_total_tokens=4096,
        speculative={"algorithm": "standalone", "draft_model": draft, "num_steps": K, "draft_pool": pool} | FIXED,
    )


def _traced_phase(target, draft, pool, tracer, monkeypatch=None):
    eng = _engine(target, draft, pool)
    if monkeypatch is not None:
        draft_pool, alloc, windows = eng.spec.drafter.runner.pool, eng.allocator, dict(eng.cfg.layer_windows)
        original = TRTLLMMHABackend.init_forward_metadata

        def mistaken(self, batch, pool_):
            if pool_ is draft_pool:
                pool_ = _UpstreamReadsByAllocator(pool_, alloc, windows, batch.out_cache_loc)
            original(self, batch, pool_)

        monkeypatch.setattr(TRTLLMMHABackend, "init_forward_metadata", mistaken)
    info = engine_info(eng)
    g = torch.Generator().manual_seed(len(pool))
    for _ in range(2):
        for n in (37, 45, 52):
            eng.add_request(
                torch.randint(0, 256, (n,), generator=g).tolist(),
                SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True),
            )
        while eng.has_unfinished():
            eng.step()
            record_step(tracer, eng.last_step, [None] * len(eng.last_step.request_ids), info, eng.kv_stats(), K)
    monkeypatch is not None and monkeypatch.undo()


def _trace_dir(tmp_path, target, draft, mistake, monkeypatch):
    _PROVIDERS.clear()
    trace_dir = str(tmp_path / "traces")
    tracer = tracer_for(TracingArgs(exporter="file", file_dir=trace_dir), "rank0")
    _traced_phase(target, draft, "swa", tracer)
    _traced_phase(target, draft, "full", tracer, monkeypatch if mistake else None)
    flush_all()
    _PROVIDERS.clear()
    return trace_dir


def test_healthy_traces_show_no_drop(models, tmp_path, monkeypatch):
    trace_dir = _trace_dir(tmp_path, *models, mistake=False, monkeypatch=monkeypatch)
    points = step_points(load_spans([trace_dir]))
    assert points and all(n == K + 1 for p in points for n in p.accept_lengths)
    text, drop = diagnose([trace_dir], str(tmp_path / "healthy.png"))
    assert drop is None and "no accept-length drop detected" in text
    assert os.path.getsize(tmp_path / "healthy.png") > 1000


def test_upstream_mistake_is_diagnosed(models, tmp_path, monkeypatch, capsys):
    from ops.cli import main

    trace_dir = _trace_dir(tmp_path, *models, mistake=True, monkeypatch=monkeypatch)
    plot = str(tmp_path / "drop.png")
    assert main(["diagnose", trace_dir, "--plot", plot]) == 0
    text = capsys.readouterr().out
    print(text)
    assert "DROP at step" in text
    assert "slidespec.draft.pool: swa -> full" in text
    _, drop = diagnose([trace_dir])
    assert drop.before == pytest.approx(K + 1) and drop.after < K
    assert "by draft pool:" in text and "by backend:" in text and "acceptance by draft position" in text
    assert os.path.getsize(plot) > 1000


@pytest.mark.parametrize("variant", ["fixed", "upstream_mistake"])
def test_accept_length_by_prefix_cache_hit(models, tmp_path, monkeypatch, variant):
    """Requests sharing a system prompt hit the prefix cache; the report breaks accept length
    down by hit. With a hit that hands the draft a prefix without its KV (the mistake of a
    cache that keeps only the target's pages), the hits' accept length falls below the misses'."""
    eng = _engine(*models, "full")
    if variant == "upstream_mistake":
        start_on, draft_pool = Scheduler._start_on, eng.spec.drafter.runner.pool

        def without_draft_kv(self, req, match):
            start_on(self, req, match)
            for buffer in draft_pool.kv_buffers:
                buffer[match.pages] = 0

        monkeypatch.setattr(Scheduler, "_start_on", without_draft_kv)
    _PROVIDERS.clear()
    trace_dir = str(tmp_path / "traces")
    tracer = tracer_for(TracingArgs(exporter="file", file_dir=trace_dir), "rank0")
    info, g = engine_info(eng), torch.Generator().manual_seed(5)
    system = torch.randint(0, 256, (60,), generator=g).tolist()
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    for wave in (1, 3):
        for _ in range(wave):
            eng.add_request(system + torch.randint(0, 256, (7,), generator=g).tolist(), greedy)
        while eng.has_unfinished():
            eng.step()
            record_step(tracer, eng.last_step, [None] * len(eng.last_step.request_ids), info, eng.kv_stats(), K)
    flush_all()
    _PROVIDERS.clear()
    text, _ = diagnose([trace_dir])
    print(text)
    groups = breakdowns(step_points(load_spans([trace_dir])))["prefix cache"]
    assert set(groups) == {"miss", "hit < 256 tokens"} and "by prefix cache:" in text
    miss, hit = (sum(groups[k]) / len(groups[k]) for k in ("miss", "hit < 256 tokens"))
    assert miss == K + 1
    assert (hit == K + 1) if variant == "fixed" else (hit < K)


def test_first_token_splits_each_requests_time_to_first_token(tmp_path):
    """`slidespec first-token` on real traces: request spans as the front door records them and
    engine-step spans in their traces, prompts long enough for several prefill chunks. Each
    request's parts are the gaps between its request span, its first step and its last prefill
    step (found apart from the decode steps after it), and add up to the TTFT the span records."""
    from cluster.telemetry import RequestTelemetry
    from ops.first_token import first_tokens, report
    from tests.hf_models import make_tiny_model

    target = str(tmp_path / "target")
    make_tiny_model("gemma3", target)
    _PROVIDERS.clear()
    trace_dir = str(tmp_path / "traces")
    tracer = tracer_for(TracingArgs(exporter="file", file_dir=trace_dir), "ingress")
    eng = Engine(model=target, page_size=4, chunked_prefill_size=16, max_total_tokens=2048)
    info, prompts, requests = engine_info(eng), {"a": 37, "b": 5}, {}
    for rid, n in prompts.items():
        body = {"request_id": rid, "prompt_token_ids": list(range(3, 3 + n)), "sampling": {"max_new_tokens": 4}}
        requests[rid] = RequestTelemetry(tracer, None, "tiny", body, {})
        eng.add_request(body["prompt_token_ids"], SamplingParams(max_new_tokens=4, temperature=0.0), request_id=rid)
    extend_steps = {rid: 0 for rid in prompts}
    while eng.has_unfinished():
        events = eng.step()
        step = eng.last_step
        record_step(tracer, step, [None] * len(step.request_ids), info, eng.kv_stats(), 0)
        if [f.mode for f in step.forwards if f.model == "target"][-1] == "EXTEND":
            for rid in step.request_ids:
                extend_steps[rid] += 1
        for rid, tokens, finished in events:
            requests[rid].update({"token_ids": tokens, "finished": finished})
    for t in requests.values():
        t.end()
    flush_all()
    _PROVIDERS.clear()
    spans = load_spans([trace_dir])
    found = {e.request_id: e for e in first_tokens(spans)}
    assert set(found) == set(prompts)
    for rid, entry in found.items():
        span = next(s for s in spans if s["attrs"].get("gen_ai.response.id") == rid)
        assert entry.in_ms >= 0 and entry.prefill_ms > 0 and entry.out_ms >= 0
        assert abs(entry.ttft_ms - 1e3 * span["attrs"]["gen_ai.server.time_to_first_token"]) < 1e-3
    steps = sorted((s for s in spans if s["name"] == "engine step"), key=lambda s: s["start"])
    a_steps = [s for s in steps if "a" in s["attrs"]["slidespec.request_ids"]]
    a_prefill = [s for s in a_steps if s["attrs"]["slidespec.forward_mode"] == "EXTEND"]
    assert len(a_prefill) == extend_steps["a"] >= 3  # 37 tokens in chunks of 16
    assert found["a"].prefill_ms == (a_prefill[-1]["end"] - a_steps[0]["start"]) / 1e6
    assert "2 requests" in report(list(found.values()))
