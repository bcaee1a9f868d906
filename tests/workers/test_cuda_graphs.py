"""The CUDA-graph path (`workers/cuda_graphs.py`) on the CPU, with replay emulated: forwards run
on the static buffers that every replay rewrites, padded to the next captured batch size,
exactly as a graph replay would, only eagerly. Greedy tokens equal the eager engine's for plain
decoding and every speculative algorithm, on a busy hybrid SWA pool; padded rows write only
the scratch pages; a graph is replayed only for the pool it was captured with; every pool is
back at its free count. (On a GPU, tests/workers/test_gpu_engine.py replays real graphs.)"""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from attention import ForwardMode
from tests.draft_models import make_eagle_head, make_frozen_kv_head, make_perturbed_copy
from tests.hf_models import WINDOW, make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams
from workers.forward_batch import ForwardBatch

GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([3 * WINDOW + 5, WINDOW + 3, 2 * WINDOW + 1, 5, 17], seed=7)  # 5 rows: graph of 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    target = str(root / "gemma3")
    make_tiny_model("gemma3", target)
    return {
        "target": target,
        "copy": make_perturbed_copy(target, str(root / "copy"), noise=0.1),
        "eagle1": make_eagle_head(target, str(root / "eagle1"), 1),
        "eagle3": make_eagle_head(target, str(root / "eagle3"), 3, draft_vocab_size=200),
        "frozen": make_frozen_kv_head(target, str(root / "frozen")),
    }


SPECS = {
    "plain": None,
    "standalone-swa": ("standalone", "copy", "swa"),
    "standalone-full": ("standalone", "copy", "full"),
    "eagle1": ("eagle", "eagle1", None),
    "eagle3": ("eagle", "eagle3", None),
    "frozen_kv_mtp": ("frozen_kv_mtp", "frozen", None),
}


def _engine(models, variant: str, page_size: int, graphs) -> Engine:
    spec = None
    if SPECS[variant] is not None:
        algorithm, draft, pool = SPECS[variant]
        spec = {"algorithm": algorithm, "draft_model": models[draft], "num_steps": 3, "adaptive": False}
        if pool:
            spec["draft_pool"] = pool
    # A small SWA pool: more than 85% of it is in use while the five requests run.
    return Engine(
        model=models["target"],
        page_size=page_size,
        attention_backend="trtllm_mha",
        max_total_tokens=1024,
        swa_full_tokens_ratio=0.12,
        chunked_prefill_size=16,
        context_length=256,
        speculative=spec,
        max_running_requests=8,
        cuda_graphs=graphs,
    )


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("variant", list(SPECS))
def test_replay_gives_the_eager_tokens(models, variant, page_size):
    ref = _engine(models, variant, page_size, False).generate(prompt_token_ids=PROMPTS, sampling=GREEDY)
    eng = _engine(models, variant, page_size, "emulate")
    outs = eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    if SPECS[variant] is not None:
        assert [o.spec.accept_lengths for o in outs] == [r.spec.accept_lengths for r in ref]
        assert eng.spec.drafter.runner.graphs.replays > 0
    assert eng.runner.graphs.replays > 0
    eng.check_no_leak()


@pytest.mark.parametrize("variant", [v for v, spec in SPECS.items() if spec is not None])
def test_one_request_verifies_flat_and_ahead_as_eager(models, variant):
    """One request: its verify runs flat (a decode row a query, short KV) and, after the first
    round, launched ahead under replay; tokens and accept lengths equal the eager engine's, and
    the tokens the greedy decode's without speculation (lossless)."""
    prompt = PROMPTS[:1]
    plain = _engine(models, "plain", 4, False).generate(prompt_token_ids=prompt, sampling=GREEDY)
    ref = _engine(models, variant, 4, False).generate(prompt_token_ids=prompt, sampling=GREEDY)
    assert [r.token_ids for r in ref] == [p.token_ids for p in plain]
    eng = _engine(models, variant, 4, "emulate")
    backend, layouts = eng.runner.backend, []
    build = backend._build_metadata

    def recorded(batch, *args, **kwargs):
        md = build(batch, *args, **kwargs)
        if md.mode == ForwardMode.TARGET_VERIFY:
            layouts.append(md.rows_per_req)
        return md

    backend._build_metadata = recorded
    outs = eng.generate(prompt_token_ids=prompt, sampling=GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.spec.accept_lengths for o in outs] == [r.spec.accept_lengths for r in ref]
    assert layouts and set(layouts) == {4}  # every verify flat: 3 drafts and the pending token
    assert eng.spec.rounds_verified_ahead > 0
    eng.check_no_leak()


@pytest.mark.parametrize("variant", [v for v, spec in SPECS.items() if spec is not None])
def test_chained_draft_steps_propose_the_eager_drafts(models, variant):
    """Under replay, drafts 2..k of a greedy round come from one chain graph (the batch moved on
    on the device between steps), mostly launched by the round before, ahead of its read, from
    accepted counts the host had not seen (frozen-KV drafts: steps 1..k, standing in for the
    catch-up), and often the round's verify too. Every round's drafts,
    accepted or not, equal the eager engine's step-by-step drafts: a rejected first draft would
    hide a wrong second one from the token comparison above."""
    engines = [_engine(models, variant, 4, graphs) for graphs in (False, "emulate")]
    for eng in engines:
        for p in PROMPTS:
            eng.add_request(p, GREEDY)
    families = engines[1].spec.drafter.runner.graphs.families
    frozen = engines[1].spec.drafter.runner.pool is None  # also steps 1..3 chained, launched ahead
    assert sorted(key.chain for key in families if key.chain) == ([2, 3] if frozen else [2])
    rounds = chain_replays = 0
    while engines[0].has_unfinished():
        for eng in engines:
            eng.step()
        eager, replayed = (eng.last_step.drafts for eng in engines)
        assert replayed == eager
        rounds += bool(eager)
        chain_replays += sum(f.steps > 1 for f in engines[1].last_step.forwards)
    assert rounds > 5 and not engines[1].has_unfinished()
    assert chain_replays >= rounds and engines[1].spec.rounds_drafted_ahead > rounds // 2
    assert engines[1].spec.rounds_verified_ahead > rounds // 4  # the rest: no pages free for the furthest outcome
    for eng in engines:
        eng.check_no_leak()


def _busy_engine(models, variant: str) -> Engine:
    """An emulated-replay engine twelve steps into the five prompts (the windows have slid)."""
    eng = _engine(models, variant, 4, "emulate")
    for p in PROMPTS:
        eng.add_request(p, GREEDY)
    for _ in range(12):
        eng.step()
    return eng


def test_a_replayed_batch_is_staged_and_never_uploads_itself(models):
    """A replay reads a built batch's host arrays (staged into the graph runner's block, one
    copy), never the batch's own device inputs; the same batch run eagerly uploads itself on
    first read and gives the replay's logits (up to the padded matmul's rounding)."""
    eng = _busy_engine(models, "plain")
    reqs = [r for r in eng.scheduler.running if r.prefilled]

    def decode_batch() -> ForwardBatch:
        starts = [r.kv_len for r in reqs]
        return ForwardBatch.build(
            ForwardMode.DECODE,
            rows=[r.row for r in reqs],
            prefix_lens=starts,
            input_ids=[r.tokens(r.kv_len, r.kv_len + 1) for r in reqs],
            out_cache_loc=eng.scheduler.slots(reqs, starts, [s + 1 for s in starts]),
            req_to_token=eng.scheduler.req_to_token,
            logits_rows=range(len(reqs)),
        )

    graphs, statics = eng.runner.graphs, []
    static_batch = graphs._static_batch
    graphs._static_batch = lambda *args: statics.append(static_batch(*args)) or statics[-1]
    batch, replays = decode_batch(), graphs.replays
    replayed = eng.runner.forward(batch).logits.clone()
    assert graphs.replays == replays + 1 and batch.inputs is None
    assert statics and all(s.logits_of_every_row(s.batch_size) for s in statics)  # no gather in the graph
    eng.runner.graphs = None
    batch = decode_batch()
    eager = eng.runner.forward(batch).logits
    assert batch.inputs is not None
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)


def test_padded_rows_write_only_scratch_pages(models):
    """Three requests replay the graph of four: KV buffers equal the eager run's (up to the
    float32 rounding of a 4-row instead of a 3-row matmul) everywhere but on the scratch pages,
    and the padded row wrote there."""
    prompts = PROMPTS[:3]
    buffers = []
    for graphs in (False, "emulate"):
        eng = _engine(models, "plain", 4, graphs)
        for p in prompts:
            eng.add_request(p, GREEDY)
        for _ in range(6):
            eng.step()
        pools = [eng.runner.pool.full, eng.runner.pool.swa]
        buffers.append([b.clone() for pool in pools for b in pool.kv_buffers])
        scratch = {"full": eng.allocator.full.reserved, "swa": eng.allocator.swa.reserved}
        layers = [len(pool.kv_buffers) for pool in pools]
        eng.shutdown()
    eager, replayed = buffers
    kinds = ["full"] * layers[0] + ["swa"] * layers[1]
    for kind, a, b in zip(kinds, eager, replayed):  # the eager engine has no scratch pages at the end
        torch.testing.assert_close(a, b[: a.shape[0]], atol=1e-5, rtol=1e-5)
        assert b.shape[0] - a.shape[0] == len(scratch[kind]) and scratch[kind][0] == a.shape[0]
        assert b[scratch[kind]].abs().sum() > 0, f"padded rows should have written the {kind} scratch page"


def test_a_graph_is_replayed_only_for_the_pool_it_was_captured_with(models):
    eng = _engine(models, "plain", 4, "emulate")
    graphs = eng.runner.graphs
    other = _engine(models, "plain", 4, False).runner.pool
    eng.add_request(PROMPTS[3], GREEDY)
    eng.step()  # prefill
    sb = eng.scheduler.schedule()
    batch = eng.scheduler.build(sb)
    assert sb.mode is ForwardMode.DECODE
    assert graphs.can_run(batch, eng.runner.pool) and not graphs.can_run(batch, other)
    eng.shutdown()


def test_scratch_pages_are_outside_every_request(models):
    eng = _engine(models, "plain", 4, "emulate")
    alloc = eng.allocator
    assert alloc.full.reserved and alloc.swa.reserved
    assert not set(alloc.full.reserved) & set(alloc.full._free)
    padding = eng.req_to_token.host[eng.req_to_token.padding_row, :4] // 4
    assert set(np.unique(padding)) == set(alloc.full.reserved)
    eng.generate(prompt_token_ids=PROMPTS, sampling=GREEDY)
    eng.check_no_leak()


def test_metadata_from_the_host_tables_equals_the_device_copies(models):
    """trtllm_mha builds page tables and SWA write slots from the host's tables (one upload per
    forward); on a busy hybrid pool whose windows have slid (evicted SWA pages) they equal what
    the device copies of the same tables give, computed here independently: for tables reaching
    every number of positions past the KV within a page (so that some request's reach ends on a
    page boundary; past it the table holds a live page's slot, which must not show), with the
    query starts summed or, for one query length a request, made once."""
    eng = _busy_engine(models, "plain")
    sb = eng.scheduler.schedule()
    batch = eng.scheduler.build(sb)
    assert sb.mode is ForwardMode.DECODE and eng.allocator._evicted, "the windows should have slid"
    eng.allocator.flush()
    pool, page = eng.runner.pool, eng.allocator.page_size
    width = eng.runner.backend.graph_table_widths()[-1]
    table = eng.req_to_token
    for row, n in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu):  # past each length: a live page's slot
        table.host[row, n:] = table.table[row, n:] = table.host[row, 0]
    cols = torch.arange(width)
    first = batch.req_to_token[batch.req_pool_indices[:, None], (cols * page)[None, :]].long()
    seq_lens, q_lens = torch.tensor(batch.seq_lens_cpu), torch.tensor(batch.q_lens_cpu)
    f2s = eng.allocator.full_to_swa
    for reach, q_len in itertools.product(range(page), (0, 1)):
        host = eng.runner.backend._host_tables(batch, pool, width, reach, q_len=q_len)
        used = cols[None, :] < ((seq_lens + reach + page - 1) // page)[:, None]
        expected = {
            "seq_lens": seq_lens,
            "cu_seq_lens_q": torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]),
            "cu_seq_lens_kv": torch.cat([torch.zeros(1, dtype=torch.int64), seq_lens.cumsum(0)]),
            "full_page_table": torch.where(used, first // page, 0),
            "swa_page_table": torch.where(used, f2s[first] // page, 0),
            "swa_out_loc": f2s[batch.out_cache_loc],
        }
        assert set(host) == set(expected)
        for name, value in expected.items():
            np.testing.assert_array_equal(host[name], value.numpy(), err_msg=f"{name}, reach {reach}, q_len {q_len}")
    eng.shutdown()


@pytest.mark.parametrize("variant, flat", [("plain", False), ("standalone-swa", False), ("standalone-swa", True)])
def test_replay_metadata_in_the_static_buffers_equals_the_eager_metadata(models, variant, flat):
    """A replay stages its metadata into one static int32 buffer (lengths, then both page tables
    packed for this batch's size and width) in one copy; every field reads back as the eager
    forward's (verify with its mask included, or flat: a row a query, no mask)."""
    eng = _busy_engine(models, variant)
    backend, pool = eng.runner.backend, eng.runner.pool
    backend.kernels = dataclasses.replace(backend.kernels, flat_verify_batch=8 if flat else 0, flat_verify_kv=1 << 20)
    reqs = [r for r in eng.scheduler.running if r.prefilled]
    q = 4 if variant != "plain" else 1
    mode = ForwardMode.TARGET_VERIFY if q > 1 else ForwardMode.DECODE
    starts = [r.num_tokens - 1 for r in reqs]
    batch = ForwardBatch.build(
        mode,
        rows=[r.row for r in reqs],
        prefix_lens=starts,
        input_ids=[[0] * q for _ in reqs],
        out_cache_loc=eng.scheduler.slots(reqs, starts, [s + q for s in starts]),
        req_to_token=eng.scheduler.req_to_token,
        logits_rows=range(len(reqs) * q),
    )
    eng.allocator.flush()
    fields = ["seq_lens", "cu_seq_lens_q", "cu_seq_lens_kv", "full_page_table", "swa_page_table", "swa_out_loc", "mask"]
    backend.init_forward_metadata(batch, pool)
    eager = {name: getattr(backend._md, name) for name in fields}
    assert eager["swa_page_table"] is not None and (eager["mask"] is not None) == (q > 1 and not flat)
    assert eager["seq_lens"].numel() == len(reqs) * (q if flat else 1)
    for _ in range(2):  # a second replay of the same shape writes everything again
        backend.init_forward_metadata_replay(batch, pool)
        for name in fields:
            value = getattr(backend._md, name)
            assert (value is None) == (eager[name] is None), name
            if value is not None:
                torch.testing.assert_close(value, eager[name], msg=name, check_dtype=False)
    eng.shutdown()


@pytest.mark.parametrize("variant", ["standalone-swa", "frozen_kv_mtp"])
def test_a_chain_moved_on_on_the_device_reads_and_writes_where_one_built_there_would(models, variant):
    """A chain launched a round ahead is built where each request would be had it accepted
    nothing, then moved on by `ahead[i]` on the device (positions, write slots, lengths; a
    read-only chain's KV end too). Its metadata then equals that of a batch built on the host at
    the moved positions: lengths, write slots (full and SWA) and every page-table column the
    kernels read (the chain's tables reach further, for its later steps)."""
    eng = _busy_engine(models, variant)
    drafter, k = eng.spec.drafter, eng.spec.num_steps
    graphs, backend, pool = drafter.runner.graphs, drafter.runner.backend, drafter.step_pool
    reqs = [r for r in eng.scheduler.running if r.prefilled]
    ahead = torch.tensor([i % (k + 1) for i in range(len(reqs))])
    hidden = torch.stack([r.spec.next_hidden for r in reqs])
    tokens = torch.zeros(len(reqs), dtype=torch.int64)
    first = 1 if drafter.runner.pool is None else 2
    base = drafter._step_batch(reqs, first, tokens, hidden, reach=2 * k, next_round=True)
    writes = not base.query_offset
    prefix = [p + int(a) for p, a in zip(base.host.positions - base.query_offset, ahead)]
    moved = ForwardBatch.build(
        ForwardMode.DECODE,
        rows=[r.row for r in reqs],
        prefix_lens=prefix,
        input_ids=[[0]] * len(reqs),
        out_cache_loc=(
            eng.scheduler.slots(reqs, prefix, [q + 1 for q in prefix]) if writes else torch.zeros(0, dtype=torch.int64)
        ),
        req_to_token=eng.scheduler.req_to_token,
        logits_rows=range(len(reqs)),
        query_offset=base.query_offset,
    )
    eng.allocator.flush()
    backend.init_forward_metadata(moved, pool)
    expected = {name: getattr(backend._md, name) for name in ("seq_lens", "full_page_table", "swa_page_table")}
    expected["swa_out_loc"] = backend._md.swa_out_loc
    key = next(key for key in graphs.families if key.chain and key.query_offset == base.query_offset)
    family, b = graphs.families[key], len(reqs)
    bs = next(size for size in graphs.batch_sizes if size >= b)
    reach = (key.chain - 1 if writes else 0) + k
    width = backend.table_width(-(-(max(base.seq_lens_cpu) + reach) // eng.allocator.page_size))
    with torch.inference_mode():  # as a replay runs (the static buffers are inference tensors)
        static = graphs._prepare(key, family, bs, graphs._padding(key, bs, b, base), width, reach)
        graphs._move(key, static, torch.cat([ahead, torch.zeros(bs - b, dtype=torch.int64)]))
    md = backend._md
    assert md.seq_lens[:b].tolist() == expected["seq_lens"].tolist() == [p + 1 for p in prefix]
    assert static.positions[:b].tolist() == moved.positions.tolist()
    if writes:
        assert static.out_cache_loc[:b].tolist() == moved.out_cache_loc.tolist()
        assert md.swa_out_loc[:b].tolist() == expected["swa_out_loc"].tolist()
    for name in ("full_page_table", "swa_page_table"):
        if expected[name] is None:
            continue
        for i, n in enumerate(expected["seq_lens"].tolist()):
            used = -(-n // eng.allocator.page_size)
            assert md.__dict__[name][i, :used].tolist() == expected[name][i, :used].tolist(), (name, i)
    eng.shutdown()
