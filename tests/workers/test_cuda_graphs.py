"""The CUDA-graph path (`workers/cuda_graphs.py`) on the CPU, with replay emulated: forwards run
on the static buffers that every replay rewrites, padded to the next captured batch size,
exactly as a graph replay would, only eagerly. Greedy tokens equal the eager engine's for plain
decoding and every speculative algorithm, on a busy hybrid SWA pool; padded rows write only
the scratch pages; a graph is replayed only for the pool it was captured with; every pool is
back at its free count. (On a GPU, tests/workers/test_gpu_engine.py replays real graphs.)"""

import numpy as np
import pytest
import torch

from attention import ForwardMode
from tests.draft_models import make_eagle_head, make_frozen_kv_head, make_perturbed_copy
from tests.hf_models import WINDOW, make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams

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
        spec = {"algorithm": algorithm, "draft_model": models[draft], "num_steps": 3}
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
    the device copies of the same tables give, computed here independently."""
    eng = _engine(models, "plain", 4, "emulate")
    for p in PROMPTS:
        eng.add_request(p, GREEDY)
    for _ in range(12):
        eng.step()
    sb = eng.scheduler.schedule()
    batch = eng.scheduler.build(sb)
    assert sb.mode is ForwardMode.DECODE and eng.allocator._evicted, "the windows should have slid"
    eng.allocator.flush()
    pool, page = eng.runner.pool, eng.allocator.page_size
    width = eng.runner.backend.graph_table_widths()[-1]
    host = eng.runner.backend._host_tables(batch, pool, width)

    cols = torch.arange(width)
    first = batch.req_to_token[batch.req_pool_indices[:, None], (cols * page)[None, :]].long()
    used = cols[None, :] < ((batch.seq_lens + page - 1) // page)[:, None]
    f2s = eng.allocator.full_to_swa
    expected = {
        "seq_lens": batch.seq_lens,
        "cu_seq_lens_q": torch.cat([torch.zeros(1, dtype=torch.int64), batch.q_lens.cumsum(0)]),
        "cu_seq_lens_kv": torch.cat([torch.zeros(1, dtype=torch.int64), batch.seq_lens.cumsum(0)]),
        "full_page_table": torch.where(used, first // page, 0),
        "swa_page_table": torch.where(used, f2s[first] // page, 0),
        "swa_out_loc": f2s[batch.out_cache_loc],
    }
    assert set(host) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(host[name], value.numpy(), err_msg=name)
    eng.shutdown()
