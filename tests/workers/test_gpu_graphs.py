"""CUDA graphs on the GPU: replayed graphs give the eager engine's greedy tokens, and logits
within bf16 noise, for every supported architecture and every speculative algorithm, on hybrid
SWA pools more than 85% full, at page sizes 16 and 64; every pool is back at its free count.
The fused kernels match their torch references."""

import pytest
import torch

from attention.kv_pool import FP8_E4M3
from tests.draft_models import make_eagle_head, make_frozen_kv_head, make_perturbed_copy
from tests.hf_models import make_tiny_model, random_prompts
from tests.workers.test_gpu_engine import compare_bf16_runs
from workers.engine import Engine, SamplingParams
from workers.memory.kv_write import write_kv_cuda, write_kv_torch
from workers.models import ops
from workers.models.layers import rope_cache
from workers.models.ops import FLASHINFER_OPS, TORCH_OPS

pytestmark = pytest.mark.gpu
SHAPE = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = random_prompts([150, 40, 97, 300, 64, 33, 210, 18])  # 8: a captured batch size throughout decoding
GREEDY = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True, return_logits=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_graphs")
    out = {}
    for name in ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"):
        window = 32 if name in ("mistral", "gemma2", "gemma3") else None
        make_tiny_model(name, str(root / name), sliding_window=window, **SHAPE)
        out[name] = str(root / name)
    target = out["gemma3"]
    out["standalone"] = make_perturbed_copy(target, str(root / "copy"), noise=0.05)
    out["eagle"] = make_eagle_head(target, str(root / "eagle3"), 3)
    out["frozen_kv_mtp"] = make_frozen_kv_head(target, str(root / "frozen"))
    return out


def _run(model: str, graphs: bool, page_size: int, spec=None, prompts=PROMPTS, sampling=GREEDY):
    # SWA pool of 12% of the full pool: more than 85% of it is in use while the requests run.
    # Graph buffers either way, so that eager decode kernels get the same bounds as replays.
    eng = Engine(
        model=model,
        device="cuda",
        dtype="bfloat16",
        page_size=page_size,
        attention_backend="trtllm_mha",
        max_total_tokens=8192,
        swa_full_tokens_ratio=0.12,
        chunked_prefill_size=64,
        max_running_requests=8,
        speculative=spec,
        cuda_graphs=True,
    )
    if not graphs:
        eng.runner.graphs = None
        if eng.spec is not None:
            eng.spec.drafter.runner.graphs = None
    outs = eng.generate(prompt_token_ids=prompts, sampling=sampling)
    eng.check_no_leak()
    replays = eng.runner.graphs.replays if eng.runner.graphs else 0
    return outs, replays


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_graph_replay_gives_the_eager_tokens(models, name, page_size):
    """Eight requests replay the graph of eight: the same kernels on the same shapes as eager,
    so the tokens are identical."""
    eager, _ = _run(models[name], False, page_size)
    replayed, replays = _run(models[name], True, page_size)
    assert replays > 0
    diverged, worst = compare_bf16_runs(eager, replayed, f"{name} page {page_size} graphs")
    print(f"{name} page {page_size}: {diverged} diverged, largest logit difference {worst:.3g}")
    assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]


def test_padded_replay_is_within_bf16_noise(models):
    """Five requests replay the graph of eight: other GEMM shapes, so bf16 rounding may differ;
    logits agree within noise until a near-tie."""
    eager, _ = _run(models["gemma3"], False, 16, prompts=PROMPTS[:5])
    replayed, replays = _run(models["gemma3"], True, 16, prompts=PROMPTS[:5])
    assert replays > 0
    diverged, worst = compare_bf16_runs(eager, replayed, "padded graphs")
    print(f"padded: {diverged} diverged, largest logit difference {worst:.3g}")


@pytest.mark.parametrize("name", ["llama", "gemma2", "gemma3"])
def test_overlapped_greedy_replay_gives_the_eager_tokens(models, name):
    """Greedy requests without logits decode overlapped: each replay of the greedy decode
    graph reads its ids from the tokens the step before left in the graph's buffer (reordered
    as requests reach their length limits) and takes its own argmax in the graph."""
    params = [SamplingParams(max_new_tokens=9 + 6 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    eager, _ = _run(models[name], False, 16, sampling=params)
    replayed, replays = _run(models[name], True, 16, sampling=params)
    assert replays > 0
    assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]


@pytest.mark.parametrize("spec", [None, "eagle", "frozen_kv_mtp"])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_batch_one_replay_gives_the_eager_tokens(models, name, spec):
    """One request: every projection of a decode step (and of a draft step) is one row, the
    GEMV's path, in the graph and eagerly."""
    if spec is not None and name != "gemma3":
        pytest.skip("the draft heads are built for the gemma3 target")
    setting = {"algorithm": spec, "draft_model": models[spec], "num_steps": 3, "adaptive": False} if spec else None
    eager, _ = _run(models[name], False, 16, setting, prompts=PROMPTS[:1])
    replayed, replays = _run(models[name], True, 16, setting, prompts=PROMPTS[:1])
    assert replays > 0
    compare_bf16_runs(eager, replayed, f"{name} {spec} batch 1")
    assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]


@pytest.mark.parametrize("name, spec", [("llama", None), ("gemma3", None), ("gemma3", "eagle")])
def test_gemv_decodes_within_bf16_noise_of_cublas(models, name, spec, monkeypatch):
    """A batch-1 decode with the GEMV against the same decode on cuBLAS: logits within bf16
    noise until a near-tie. The GEMV must have run (eagerly, and while the graphs were captured):
    on one row, and with a draft on the verify forward's several rows too."""
    from workers.models import gemv  # Triton: CUDA builds of torch only

    rows: dict[str, set[int]] = {"gemv": set(), "gemv_act_and_mul": set()}
    for kernel in rows:
        launch = getattr(gemv, kernel)

        def counted(x, *args, _launch=launch, _kernel=kernel, **kwargs):
            rows[_kernel].add(x.numel() // x.shape[-1])
            return _launch(x, *args, **kwargs)

        monkeypatch.setattr(gemv, kernel, counted)
    setting = {"algorithm": spec, "draft_model": models[spec], "num_steps": 3, "adaptive": False} if spec else None
    runs = {}
    for enabled in (False, True):
        monkeypatch.setattr(ops, "GEMV_ENABLED", enabled)
        runs[enabled], replays = _run(models[name], True, 16, setting, prompts=PROMPTS[:1])
        assert replays > 0
        assert all(rows.values()) == enabled, rows
    assert all(1 in seen for seen in rows.values()), rows
    if spec:  # the verify forward: the three draft tokens and one more
        assert all(4 in seen for seen in rows.values()), rows
    diverged, worst = compare_bf16_runs(runs[False], runs[True], f"{name} {spec} gemv")
    print(f"{name} {spec} gemv: {diverged} diverged, largest logit difference {worst:.3g}")


@pytest.mark.parametrize("algorithm", ["standalone", "eagle", "frozen_kv_mtp"])
def test_speculative_rounds_replay_graphs(models, algorithm):
    spec = {"algorithm": algorithm, "draft_model": models[algorithm], "num_steps": 4, "adaptive": False}
    eager, _ = _run(models["gemma3"], False, 16, spec)
    replayed, replays = _run(models["gemma3"], True, 16, spec)
    assert replays > 0
    diverged, worst = compare_bf16_runs(eager, replayed, f"{algorithm} graphs")
    print(f"{algorithm}: {diverged} diverged, largest logit difference {worst:.3g}")
    assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]
    assert [o.spec.accept_lengths for o in replayed] == [o.spec.accept_lengths for o in eager]


@pytest.mark.parametrize("gemma", [False, True])
def test_fused_norms_match_the_reference(gemma):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 1152, device="cuda", generator=g).bfloat16()
    res = torch.randn(37, 1152, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1152, device="cuda", generator=g) * 0.1 + (0 if gemma else 1)).bfloat16()
    assert _rel(FLASHINFER_OPS.rms_norm(x, w, 1e-6, gemma), TORCH_OPS.rms_norm(x, w, 1e-6, gemma)) < 1e-2
    heads = torch.randn(37, 8, 128, device="cuda", generator=g).bfloat16()  # q/k norms: per head
    wh = w[:128].contiguous()
    assert _rel(FLASHINFER_OPS.rms_norm(heads, wh, 1e-6, gemma), TORCH_OPS.rms_norm(heads, wh, 1e-6, gemma)) < 1e-2
    ref_y, ref_r = TORCH_OPS.add_rms_norm(x, res, w, 1e-6, gemma)
    y, r = FLASHINFER_OPS.add_rms_norm(x.clone(), res.clone(), w, 1e-6, gemma)
    assert _rel(r, ref_r) < 1e-2 and _rel(y, ref_y) < 1e-2


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("hidden", [1152, 3840, 1000])
def test_sandwich_norm_matches_the_reference(gemma, hidden):
    """norm(residual + norm(x, before)) in one kernel, against the torch ops; rows of a wider
    tensor (a strided view) and zero rows."""
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(37, hidden + 8, device="cuda", generator=g).bfloat16()[:, :hidden]
    res = torch.randn(37, hidden, device="cuda", generator=g).bfloat16()
    w, before = ((torch.randn(hidden, device="cuda", generator=g) * 0.1 + (0 if gemma else 1)).bfloat16() for _ in "ab")
    ref_y, ref_r = TORCH_OPS.add_rms_norm(x, res, w, 1e-6, gemma, before)
    y, r = FLASHINFER_OPS.add_rms_norm(x, res.clone(), w, 1e-6, gemma, before)
    assert _rel(r, ref_r) < 1e-2 and _rel(y, ref_y) < 1e-2
    empty = FLASHINFER_OPS.add_rms_norm(x[:0], res[:0].clone(), w, 1e-6, gemma, before)
    assert empty[0].shape == (0, hidden)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("shape", [(1536, 1152), (37, 264), (6144, 4096)])
def test_qkv_projection_of_its_norm_matches_the_reference(gemma, shape):
    """The QKV projection with the norm before it inside (one row of a small projection: one
    kernel; other rows and shapes: the norm kernel, then the projection), against the torch ops;
    the input residual stays as it was where the fused kernel writes a new one."""
    out_features, hidden = shape
    g = torch.Generator(device="cuda").manual_seed(4)
    w = (torch.randn(out_features, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    norm, before = (
        (torch.randn(hidden, device="cuda", generator=g) * 0.1 + (0 if gemma else 1)).bfloat16() for _ in "nb"
    )
    for rows in (1, 3):
        for w_before in (before, None):
            x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
            res = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
            ref_y, ref_r = TORCH_OPS.add_rms_norm_linear(x, res.clone(), norm, 1e-6, gemma, w_before, w, None)
            y, r = FLASHINFER_OPS.add_rms_norm_linear(x.clone(), res.clone(), norm, 1e-6, gemma, w_before, w, None)
            assert _rel(r, ref_r) < 1e-2 and _rel(y, ref_y) < 1e-2, (rows, w_before is None)


@pytest.mark.parametrize("shape", [(1536, 1152), (256, 2560), (3072, 2560)])
def test_scaled_streams_and_their_projections_match_the_reference(shape):
    """Gemma 4's stream ends: the norm, add and layer scalar before the next layer's norm (and
    its projection), the stream alone, and the stream projected unnormed (the per-layer input
    gate), one row and three, against the torch ops."""
    out_features, hidden = shape
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(out_features, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    norm, before = ((torch.randn(hidden, device="cuda", generator=g) * 0.1 + 1).bfloat16() for _ in "nb")
    scale = torch.tensor([0.6], device="cuda").bfloat16()
    for rows in (1, 3):
        x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
        res = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
        ref_y, ref_r = TORCH_OPS.add_rms_norm(x, res.clone(), norm, 1e-6, False, before, scale)
        y, r = FLASHINFER_OPS.add_rms_norm(x.clone(), res.clone(), norm, 1e-6, False, before, scale)
        assert _rel(r, ref_r) < 1e-2 and _rel(y, ref_y) < 1e-2, rows
        for s in (scale, None):  # the stream alone (Gemma 4's MoE branches: no scale)
            ref = TORCH_OPS.norm_add(x, res.clone(), before, 1e-6, False, s)
            assert _rel(FLASHINFER_OPS.norm_add(x, res.clone(), before, 1e-6, False, s), ref) < 1e-2, rows
        ref = TORCH_OPS.rms_norm(res, norm, 1e-6, True) + TORCH_OPS.rms_norm(x, before, 1e-6, True)
        got = FLASHINFER_OPS.norm_add(x, res.clone(), before, 1e-6, True, None, norm)  # two normed branches
        assert _rel(got, ref) < 1e-2, rows
        for n in (norm, None):
            args = (n, 1e-6, False, before, w, None, scale)
            ref_y, ref_r = TORCH_OPS.add_rms_norm_linear(x, res.clone(), *args)
            y, r = FLASHINFER_OPS.add_rms_norm_linear(x.clone(), res.clone(), *args)
            assert _rel(r, ref_r) < 1e-2 and _rel(y, ref_y) < 1e-2, (rows, n is None)


@pytest.mark.parametrize("rows", [1, 3])
def test_gated_projection_matches_the_reference(rows):
    """W . (act(gate) * up) with gate and up apart: one row in one kernel (a strided row of the
    per-layer inputs as up), more rows composed."""
    g = torch.Generator(device="cuda").manual_seed(6)
    w = (torch.randn(2560, 256, device="cuda", generator=g) * 0.05).bfloat16()
    gate = torch.randn(rows, 256, device="cuda", generator=g).bfloat16()
    up = torch.randn(rows, 42, 256, device="cuda", generator=g).bfloat16()[:, 7]
    ref = TORCH_OPS.gated_linear(gate, up, "gelu_pytorch_tanh", w, None)
    assert _rel(FLASHINFER_OPS.gated_linear(gate, up, "gelu_pytorch_tanh", w, None), ref) < 1e-2


@pytest.mark.parametrize("norms", [None, "llama", "gemma"])
@pytest.mark.parametrize("head_dim, rotary", [(128, 128), (256, 256), (128, 64)])
def test_fused_rope_matches_the_reference(head_dim, rotary, norms):
    """RoPE on strided q/k views, with the per-head q/k norms folded in or not; queries alone
    (a frozen-KV draft's layer)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2, device="cuda").float() / rotary))
    cache = rope_cache(inv_freq, 1.0, 4096)
    positions = torch.randint(0, 4096, (53,), device="cuda", generator=g)
    qkv = torch.randn(53, 12, head_dim, device="cuda", generator=g).bfloat16()
    q, k = qkv[:, :8], qkv[:, 8:10]  # strided views, as split from a fused projection
    qk_norms = None
    if norms:
        shift = 0 if norms == "gemma" else 1
        wq, wk = ((torch.randn(head_dim, device="cuda", generator=g) * 0.1 + shift).bfloat16() for _ in "qk")
        qk_norms = (wq, wk, 1e-6, norms == "gemma")
    ref_q, ref_k = TORCH_OPS.rope(positions, q.clone(), k.clone(), cache, qk_norms)
    out_q, out_k = FLASHINFER_OPS.rope(positions, q.clone(), k.clone(), cache, qk_norms)
    assert _rel(out_q, ref_q) < 1e-2 and _rel(out_k, ref_k) < 1e-2
    q_norms = None if qk_norms is None else (qk_norms[0], None, *qk_norms[2:])
    only_q, none = FLASHINFER_OPS.rope(positions, q, None, cache, q_norms)
    assert none is None and _rel(only_q, TORCH_OPS.rope(positions, q, None, cache, q_norms)[0]) < 1e-2


@pytest.mark.parametrize("v_norm", [None, 1e-6])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_rope_writes_kv_like_the_reference(page, gemma, kv, v_norm):
    """RoPE (with q/k norms on Gemma) writing the rotated keys and the values (each head normed
    first with `v_norm`, Gemma 4) into a paged cache at scattered slots, against the torch ops'
    rotate-then-write: same queries, same cache. An
    FP8 cache quantises with K scale 0.5 and V scale 2 (values bit for bit as the reference;
    keys rotate in float32 here and in bf16 there, so some round to the neighbouring FP8 value)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    head_dim, tokens, q_heads, k_heads = 256 if gemma else 128, 41, 8, 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    cache = rope_cache(inv_freq, 1.0, 4096)
    positions = torch.randint(0, 4096, (tokens,), device="cuda", generator=g)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, device="cuda", generator=g).bfloat16()
    q, k, v = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, q_heads, head_dim), k.reshape(tokens, k_heads, head_dim)
    norms = None
    if gemma:
        norms = (*((torch.randn(head_dim, device="cuda", generator=g) * 0.1).bfloat16() for _ in "qk"), 1e-6, True)
    slots = torch.randperm(8 * page, device="cuda", generator=g)[:tokens] + page
    dtype, scales = (torch.bfloat16, (1.0, 1.0)) if kv == "bf16" else (FP8_E4M3, (0.5, 2.0))
    ref_cache, out_cache = (torch.zeros(9, 2, k_heads, page, head_dim, device="cuda").to(dtype) for _ in "ro")
    ref_q, _ = TORCH_OPS.rope(positions, q, k, cache, norms, (ref_cache, slots, v, scales), v_norm)
    out_q, out_k = FLASHINFER_OPS.rope(positions, q, k, cache, norms, (out_cache, slots, v, scales), v_norm)
    assert out_k is None and _rel(out_q, ref_q) < 1e-2
    keys, ref_keys = out_cache[:, 0].float(), ref_cache[:, 0].float()
    if kv == "bf16":
        assert _rel(keys, ref_keys) < 1e-2
    else:  # dequantised, a key differs by at most one FP8 step (1/8 relative) past the reference's
        # own bf16 rounding (its rotation rounds every product: up to ~2^-6 where terms cancel; about
        # 4% of keys then round to the neighbouring FP8 value); a wrong scale is off by 2x or more
        assert torch.isclose(keys * scales[0], ref_keys * scales[0], rtol=0.125, atol=2**-6).all()
    values, ref_values = out_cache[:, 1], ref_cache[:, 1]
    if v_norm is None:  # values copied (quantised as the reference quantises them)
        assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
    else:  # normed: float32 statistics summed in another order, a few round to the neighbour
        assert _rel(values.float(), ref_values.float()) < 2e-2
    assert not out_cache[0].view(torch.uint8).any()  # padding page 0 untouched


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_kv_writer_stores_what_the_reference_stores(kv):
    """The Triton KV writer against the torch reference, bit for bit: a cast into a bf16 cache,
    `quantize` (scale, saturate at 448, round to nearest) into an FP8 one, values past the
    range included."""
    g = torch.Generator(device="cuda").manual_seed(5)
    tokens, heads, head_dim, page = 37, 4, 128, 16
    k, v = (torch.randn(tokens, heads, head_dim, device="cuda", generator=g).bfloat16() * 200 for _ in "kv")
    slots = torch.randperm(6 * page, device="cuda", generator=g)[:tokens] + page
    dtype, scales = (torch.bfloat16, (1.0, 1.0)) if kv == "bf16" else (FP8_E4M3, (0.5, 2.0))
    ref, out = (torch.zeros(7, 2, heads, page, head_dim, device="cuda").to(dtype) for _ in "ro")
    write_kv_torch(ref, slots, k, v, *scales)
    write_kv_cuda(out, slots, k, v, *scales)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("cap", [None, 30.0])
@pytest.mark.parametrize("rows, vocab", [(1, 262144), (3, 128256), (8, 1000), (2, 4096)])
def test_logits_argmax_matches_the_reference_and_leaves_its_counters_at_zero(rows, vocab, cap):
    """Float32 (soft-capped) logits as the torch op computes them, and the first index of each
    row's maximum, ties across chunks included; the LM head's rows may be strided."""
    from attention.kernels import arrival

    raw = torch.randn(rows, vocab + 64, device="cuda").bfloat16()[:, :vocab]
    raw[0, [3, vocab - 2]] = 40.0  # a tie between the first and the last chunk: the first wins
    raw[1:, vocab - 1] = 41.0
    out = torch.full((rows, vocab), float("nan"), device="cuda")
    tokens = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    FLASHINFER_OPS.logits_argmax(raw, cap, out, tokens)
    ref_out = torch.empty_like(out)
    ref_tokens = torch.empty_like(tokens)
    TORCH_OPS.logits_argmax(raw, cap, ref_out, ref_tokens)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    assert tokens.tolist() == ref_tokens.tolist()
    assert tokens[0].item() == 3 and tokens[1:].tolist() == [vocab - 1] * (rows - 1)
    assert int(arrival.counters(raw.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_fused_activation_matches_the_reference(act):
    x = torch.randn(29, 2 * 6912, device="cuda").bfloat16()
    assert _rel(FLASHINFER_OPS.act_and_mul(x, act), TORCH_OPS.act_and_mul(x, act)) < 1e-2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "out_features, in_features",
    [
        (6144, 4096),
        (4096, 14336),
        (16040, 4096),
        (16400, 1000),
        (65600, 264),
        (30760, 1000),
        (8200, 3840),
        (4096, 4096),
        (1152, 1000),
        (1152, 6912),
        (1000, 6500),
        (37, 264),
    ],
)
def test_gemv_matches_a_float32_reference(out_features, in_features, bias):
    """Every tile of both tables, K a multiple of the tile's width or not, N a multiple of its
    rows or not; rows sliced from a wider tensor; one to MAX_ROWS rows take the GEMV where the
    table gives a tile, the rest cuBLAS."""
    from workers.models import gemv  # Triton: CUDA builds of torch only

    g = torch.Generator(device="cuda").manual_seed(2)
    w = (torch.randn(out_features, in_features, device="cuda", generator=g) * 0.05).bfloat16()
    b = torch.randn(out_features, device="cuda", generator=g).bfloat16() if bias else None
    for rows in (1, 2, 5, gemv.MAX_ROWS, gemv.MAX_ROWS + 1):
        wide = torch.randn(rows, in_features + 8, device="cuda", generator=g).bfloat16()
        x = wide[:, 3 : 3 + in_features]
        tiled = rows <= gemv.MAX_ROWS and gemv.tile_for(out_features, in_features, rows) is not None
        assert gemv.applies(x, w) == tiled
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float() if bias else None)
        assert _rel(FLASHINFER_OPS.linear(x, w, b), ref) < 1e-2, rows


@pytest.mark.parametrize("splits", [2, 3, 4, 6])
def test_split_k_gemv_matches_a_float32_reference_and_leaves_its_counters_at_zero(splits):
    """The last program of each row block adds the others' partial sums: every split count,
    K a multiple of the tile's width or not, N a multiple of its rows or not, called again with
    the counters the first call left (the kernel resets them)."""
    from attention.kernels import arrival
    from workers.models import gemv

    g = torch.Generator(device="cuda").manual_seed(splits)
    for n, k in ((1152, 6912), (1001, 5000)):
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
        b = torch.randn(n, device="cuda", generator=g).bfloat16()
        x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
        for _ in range(3):
            assert _rel(gemv.gemv(x, w, b, tile=gemv.Tile(4, 256, 4, 3, splits=splits)), ref) < 1e-2
    assert int(arrival.counters(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("intermediate, hidden", [(15360, 3840), (14336, 4096), (6912, 1152), (100, 264)])
def test_fused_gate_up_gemv_matches_a_float32_reference(act, intermediate, hidden):
    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(2 * intermediate, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    for rows in (1, 5, 8, 9):
        x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
        ref = TORCH_OPS.linear_act_and_mul(x.float(), w.float(), None, act)
        assert _rel(FLASHINFER_OPS.linear_act_and_mul(x, w, None, act), ref) < 1e-2, rows


@pytest.mark.parametrize("intermediate, hidden", [(6912, 1152), (4096, 512), (100, 264)])
def test_unrolled_gate_up_gemv_gives_the_looped_tiles_sums(intermediate, hidden):
    """Unrolling K changes when loads are issued, not what is added in which order: bit-equal
    to the loop (K not a multiple of the tile: the loop itself)."""
    from workers.models import gemv  # Triton: CUDA builds of torch only

    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(2 * intermediate, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    x = torch.randn(1, hidden, device="cuda", generator=g).bfloat16()
    looped = gemv.gemv_act_and_mul(x, w, "gelu_pytorch_tanh", tile=gemv.Tile(8, 128, 8, 1))
    unrolled = gemv.gemv_act_and_mul(x, w, "gelu_pytorch_tanh", tile=gemv.Tile(8, 128, 8, 1, unroll=True))
    assert torch.equal(unrolled, looped)
    assert _rel(unrolled, TORCH_OPS.linear_act_and_mul(x.float(), w.float(), None, "gelu_pytorch_tanh")) < 1e-2


@pytest.mark.parametrize(
    "gemma, out_features, hidden, fused",
    [(True, 1536, 1152, True), (False, 1024, 512, True), (False, 6144, 4096, False)],
)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_first_layer_gemv_from_a_token_id_matches_the_reference(gemma, out_features, hidden, fused, id_dtype):
    """The embedding row, Gemma's scale (rounded to bf16 first), the input norm and the QKV
    projection in one kernel (or, for a QKV too wide for it, composed of the device's ops): the
    stream bit-equal to torch's, the projection within bf16 noise of a float32 one."""
    from workers.models import gemv  # Triton: CUDA builds of torch only

    g = torch.Generator(device="cuda").manual_seed(7)
    table = torch.randn(1000, hidden, device="cuda", generator=g).bfloat16()
    norm = (torch.randn(hidden, device="cuda", generator=g) * 0.1).bfloat16()
    weight = (torch.randn(out_features, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    scale = hidden**0.5 if gemma else 1.0
    assert gemv.norm_applies(table[:1], weight) == fused  # which of the two paths runs
    for token in (0, 7, 999):
        ids = torch.tensor([token], dtype=id_dtype, device="cuda")
        y, stream = FLASHINFER_OPS.embed_rms_norm_linear(ids, table, scale, norm, 1e-6, gemma, weight, None)
        _, ref_stream = TORCH_OPS.embed_rms_norm_linear(ids.long(), table, scale, norm, 1e-6, gemma, weight, None)
        assert torch.equal(stream, ref_stream)
        normed = TORCH_OPS.rms_norm(stream.float(), norm.float(), 1e-6, gemma)
        assert _rel(y, normed @ weight.float().T) < 1e-2


@pytest.mark.parametrize(
    "out_features, in_features, splits", [(1152, 6912, 6), (40, 1000, 3), (4096, 14336, 1), (2560, 10240, 12)]
)
def test_unrolled_split_gemv_gives_the_looped_tiles_sums(out_features, in_features, splits):
    """A split's K tiles unrolled (the last split's past K masked, and splits that start past K:
    Gemma-4-E4B's down projection in twelve splits of 1,024): bit-equal to the loop."""
    from workers.models import gemv  # Triton: CUDA builds of torch only

    g = torch.Generator(device="cuda").manual_seed(6)
    w = (torch.randn(out_features, in_features, device="cuda", generator=g) * 0.05).bfloat16()
    x = torch.randn(1, in_features, device="cuda", generator=g).bfloat16()
    looped = gemv.gemv(x, w, tile=gemv.Tile(8, 256, 4, 1, splits))
    unrolled = gemv.gemv(x, w, tile=gemv.Tile(8, 256, 4, 1, splits, unroll=True))
    assert torch.equal(unrolled, looped)
    assert _rel(unrolled, x.float() @ w.float().T) < 1e-2


@pytest.mark.parametrize("page_size, head_dim", [(16, 128), (64, 256), (16, 64)])
def test_fused_kv_write_matches_the_reference(page_size, head_dim):
    g = torch.Generator(device="cuda").manual_seed(2)
    buf = torch.randn(40, 2, 4, page_size, head_dim, device="cuda", generator=g).bfloat16()
    locs = torch.randperm(39 * page_size, device="cuda", generator=g)[:77] + page_size  # distinct, past page 0
    qkv = torch.randn(77, 12, head_dim, device="cuda", generator=g).bfloat16()
    k, v = qkv[:, 4:8], qkv[:, 8:12]  # strided views, as split from a fused projection
    ref, out = buf.clone(), buf.clone()
    write_kv_torch(ref, locs, k, v)
    write_kv_cuda(out, locs, k, v)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("spec", [None, "standalone", "eagle", "frozen_kv_mtp"])
def test_prefix_cache_hits_under_graph_replay(models, spec, page_size):
    """A shared system prompt longer than the window, then an exact repeat: with the cache on,
    the hits replay the same graphs and give the cache-off run's tokens within the bf16
    criterion; the hits are page aligned and hit both pools."""
    system = random_prompts([200], seed=21)[0]
    first = [system + [240 + i] + tail for i, tail in enumerate(random_prompts([5, 9, 17, 30, 2, 11, 40, 7], seed=22))]
    draft = {"algorithm": spec, "draft_model": models[spec], "num_steps": 3, "adaptive": False} if spec else None
    runs = {}
    for caching in (False, True):
        eng = Engine(
            model=models["gemma3"],
            device="cuda",
            dtype="bfloat16",
            page_size=page_size,
            attention_backend="trtllm_mha",
            max_total_tokens=8192,
            swa_full_tokens_ratio=0.5,  # room for the cache's SWA pages: no eviction cuts a hit
            chunked_prefill_size=64,
            max_running_requests=8,
            speculative=draft,
            enable_prefix_caching=caching,
        )
        outs = eng.generate(prompt_token_ids=first[:1], sampling=GREEDY)
        outs += eng.generate(prompt_token_ids=first[1:], sampling=GREEDY)
        outs += eng.generate(prompt_token_ids=first[1:2], sampling=GREEDY)  # an exact repeat
        eng.check_no_leak()
        eng.flush_cache()
        eng.allocator.check_no_leak()
        runs[caching] = outs
    hits = [o.cached_tokens for o in runs[True]]
    shared = (200 if spec != "eagle" else 199) // page_size * page_size
    assert hits[0] == 0 and hits[1:8] == [shared] * 7
    assert hits[8] == (len(first[1]) - 1) // page_size * page_size
    diverged, worst = compare_bf16_runs(runs[False], runs[True], f"prefix cache {spec} page {page_size}")
    print(f"prefix cache {spec} page {page_size}: {diverged} diverged, largest logit difference {worst:.3g}")
