"""Gemma 4 (dense, text) against Hugging Face transformers, float32 on CPU.

The tiny model (`tests/hf_models.py`) has both geometries (sliding layers: 2 KV heads of 16;
full layers: 1 KV head of 32 whose V is the K projection), per-layer embeddings, two KV-sharing
layers with double-wide MLPs and proportional RoPE. Greedy tokens equal `generate`'s and every
generated token's logits are within float32 noise of the full forward's, on both backends (the
CPU reference kernels behind trtllm_mha), page sizes 16 and 64, chunked prefill, prompts longer
than the window, a second wave hitting the prefix cache, emulated CUDA graphs and speculative
decoding (its own assistant among the drafts: tests/workers/test_gemma4_assistant.py); no KV
leaks.
"""

import json
import logging
import os
import shutil

import pytest
import torch
import transformers

from attention import AttentionLayer
from attention.kernels import KERNEL_SETS
from attention.trtllm_mha import TRTLLMMHABackend
from tests.draft_models import make_eagle_head, make_gemma4_assistant, make_perturbed_copy
from tests.hf_models import COMMON, TINY_MODELS, WINDOW, make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams
from workers.models.config import model_config_from_hf

NEW_TOKENS = 24
FIRST = random_prompts([70, WINDOW + 3, 2 * WINDOW + 1], seed=2)
PROMPTS = FIRST + [FIRST[0][:66] + [7, 8, 9]]  # the second wave starts on the first's pages
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)


def hf_reference(model: transformers.PreTrainedModel, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """(greedy continuation, logits of every generated token) of each prompt."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
            logits = model(gen[:, :-1]).logits[0].float()[len(prompt) - 1 :]
            out.append((gen[0, len(prompt) :].tolist(), logits))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma4"))
    return path, hf_reference(make_tiny_model("gemma4", path), PROMPTS)


def generate_waves(eng: Engine) -> list:
    """The first prompts, then the second wave (after the first finished: its pages are cached)."""
    outs = eng.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    return outs + eng.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=GREEDY)


def assert_matches(outs, expected, what: str) -> None:
    for i, (out, (tokens, logits)) in enumerate(zip(outs, expected)):
        diff = (torch.stack(out.logits) - logits).abs().max().item()
        assert diff <= 1e-4, f"{what} prompt {i}: max |logit diff| {diff:.2e}"
        assert out.token_ids == tokens, f"{what} prompt {i}: greedy tokens differ from transformers"


@pytest.mark.parametrize("backend", ["torch_native", "trtllm_mha"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_matches_transformers(reference, backend, page_size):
    path, expected = reference
    eng = Engine(
        model=path,
        dtype="float32",
        page_size=page_size,
        attention_backend=backend,
        max_total_tokens=4096,
        chunked_prefill_size=5,
    )
    outs = generate_waves(eng)
    assert_matches(outs, expected, f"{backend} page {page_size}")
    assert outs[-1].cached_tokens >= 64, "the second wave should start on cached pages"
    eng.check_no_leak()
    eng.flush_cache()
    eng.allocator.check_no_leak()


def test_emulated_graphs_match_transformers(reference):
    path, expected = reference
    eng = Engine(
        model=path,
        dtype="float32",
        page_size=16,
        attention_backend="trtllm_mha",
        max_total_tokens=4096,
        chunked_prefill_size=16,
        cuda_graphs="emulate",
        max_running_requests=4,
    )
    assert eng.runner.graphs is not None
    assert_matches(generate_waves(eng), expected, "emulated graphs")
    eng.check_no_leak()


@pytest.mark.parametrize("draft", ["standalone-swa", "standalone-full", "eagle3", "assistant"])
def test_speculative_decoding_keeps_transformers_tokens(reference, tmp_path, draft):
    """A Gemma 4 target verifying drafts (a perturbed copy of itself in an SWA or a full-only
    pool, an EAGLE-3 head reading three of its layers, or a Gemma 4 assistant reading its KV)
    under emulated graphs, in fixed rounds (what is accepted is then the draft's doing, not the
    controller's choice of rounds): the target's greedy tokens and logits, and the copy's drafts
    (and some of the assistant's, which favours repeating its input token) are accepted."""
    path, expected = reference
    if draft == "eagle3":
        spec = dict(algorithm="eagle", draft_model=make_eagle_head(path, str(tmp_path / "eagle"), 3))
    elif draft == "assistant":
        spec = dict(algorithm="mtp", draft_model=make_gemma4_assistant(path, str(tmp_path / "assistant"), copies=10.0))
    else:
        copy = make_perturbed_copy(path, str(tmp_path / "copy"), noise=0.1)
        spec = dict(algorithm="standalone", draft_model=copy, draft_pool=draft.split("-")[1])
    eng = Engine(
        model=path,
        dtype="float32",
        page_size=16,
        attention_backend="trtllm_mha",
        max_total_tokens=4096,
        speculative={**spec, "num_steps": 3, "adaptive": False},
        cuda_graphs="emulate",
        max_running_requests=4,
    )
    outs = eng.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    assert_matches(outs, expected, f"{draft} draft")
    lengths = [n for o in outs for n in o.spec.accept_lengths]
    if draft == "assistant":
        assert max(lengths) > 1, lengths
    else:
        assert draft == "eagle3" or sum(lengths) / len(lengths) > 1.2, lengths
    eng.check_no_leak()


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_layers_too_wide_for_the_multi_query_kernels_read_one_query_a_row(reference, tmp_path, monkeypatch, graphs):
    """Hopper's multi-query kernels take heads of at most 256 (Gemma 4's full layers have 512):
    a model with such a layer reads every prefill, verify and catch-up one query a row, every
    layer, through the one-query decode kernel. Here the CPU kernel set draws that line at 16
    dims (the full layers have 32): prefills, chunked and cached, and a standalone draft's verify
    rounds of several requests (flat) still give transformers' tokens."""
    import dataclasses

    path, expected = reference
    monkeypatch.setitem(KERNEL_SETS, "cpu", dataclasses.replace(KERNEL_SETS["cpu"], multi_query_max_head_dim=16))
    copy = make_perturbed_copy(path, str(tmp_path / "copy"), noise=0.1)
    eng = Engine(
        model=path,
        dtype="float32",
        page_size=16,
        attention_backend="trtllm_mha",
        max_total_tokens=4096,
        chunked_prefill_size=16,
        speculative={"algorithm": "standalone", "draft_model": copy, "num_steps": 3},
        cuda_graphs=graphs,
        max_running_requests=4,
    )
    assert eng.runner.backend._has_wide and eng.spec.drafter.runner.backend._has_wide  # both have 32-dim full layers
    assert_matches(generate_waves(eng), expected, f"one query a row, graphs {graphs}")
    eng.check_no_leak()


def test_kv_sharing_layers_take_no_pool_space(reference):
    """Layers 4 and 5 read layers 3 and 2's KV: only the four other layers have buffers, each in
    its own geometry, and the bytes a slot holds count those four only."""
    path, _ = reference
    eng = Engine(model=path, dtype="float32", page_size=16, max_total_tokens=512)
    assert [a.layer_id for a in eng.runner.model.attention_layers] == [0, 1, 2, 3, 3, 2]
    pool = eng.runner.pool
    assert sorted(pool.swa._index) == [0, 1, 3] and sorted(pool.full._index) == [2]
    assert {tuple(b.shape[2::2]) for b in pool.swa.kv_buffers} == {(2, 16)}  # KV heads, head size
    assert pool.full.kv_cache(2).shape[2::2] == (1, 32)
    stats = eng.kv_stats()
    assert stats["swa_slot_bytes"] == 3 * 2 * 2 * 16 * 4 and stats["full_slot_bytes"] == 2 * 1 * 32 * 4
    shared = eng.runner.model.model.layers[4].self_attn
    assert shared.qkv_proj is None and not hasattr(shared, "k_norm")


def test_checkpoint_config_json_with_global_head_fields(reference, tmp_path):
    """Gemma 4 checkpoints state the full layers' geometry as `global_head_dim` and
    `num_global_key_value_heads` (transformers' save_pretrained writes `per_layer_config`):
    both give the same model."""
    path, expected = reference
    shutil.copytree(path, tmp_path / "model")
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert set(cfg.pop("per_layer_config")["2"]) == {"head_dim", "num_key_value_heads"}
    cfg.update(global_head_dim=32, num_global_key_value_heads=1)
    json.dump(cfg, open(tmp_path / "model" / "config.json", "w"))
    eng = Engine(model=str(tmp_path / "model"), dtype="float32", page_size=16, max_total_tokens=2048)
    assert [(layer.head_dim, layer.num_kv_heads, layer.k_eq_v) for layer in eng.cfg.layers[:3]] == [
        (16, 2, False),
        (16, 2, False),
        (32, 1, True),
    ]
    assert_matches(eng.generate(prompt_token_ids=FIRST[1:], sampling=GREEDY), expected[1:3], "global head fields")
    eng.check_no_leak()


def test_multimodal_checkpoint_serves_its_language_model(tmp_path, caplog):
    """A Gemma4ForConditionalGeneration checkpoint: the text model's tensors load (under
    model.language_model), the vision tower's are left out with one log line, and the tokens are
    the multimodal model's own on text prompts."""
    _, _, text = TINY_MODELS["gemma4"]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    config = transformers.Gemma4Config(
        text_config={**COMMON, **text, "pad_token_id": 0}, vision_config=vision, eos_token_id=None
    )
    config.architectures = ["Gemma4ForConditionalGeneration"]
    torch.manual_seed(1)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    model.save_pretrained(str(tmp_path))
    expected = hf_reference(model, FIRST[1:])
    with caplog.at_level(logging.INFO, logger="workers.models.gemma4"):
        eng = Engine(model=str(tmp_path), dtype="float32", page_size=16, max_total_tokens=2048)
    notes = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(notes) == 1 and "model.vision_tower" in notes[0] and "model.embed_vision" in notes[0], notes
    assert eng.cfg.architecture == "Gemma4ForConditionalGeneration"
    assert_matches(eng.generate(prompt_token_ids=FIRST[1:], sampling=GREEDY), expected, "multimodal checkpoint")
    eng.check_no_leak()


def test_random_weights_keep_layer_scalars_at_identity(reference, tmp_path):
    path, _ = reference
    os.makedirs(tmp_path / "config_only")
    shutil.copy(os.path.join(path, "config.json"), tmp_path / "config_only")
    eng = Engine(model=str(tmp_path / "config_only"), load_format="dummy", page_size=16, max_total_tokens=512)
    assert all(float(layer.layer_scalar) == 1.0 for layer in eng.runner.model.model.layers)
    (out,) = eng.generate(prompt_token_ids=FIRST[1:2], sampling=SamplingParams(max_new_tokens=4))
    assert len(out.token_ids) == 4
    eng.check_no_leak()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all' is not supported"),
        ({"vocab_size_per_layer_input": 128}, "vocab_size_per_layer_input 128 is below vocab_size 256"),
        ({"num_kv_shared_layers": 6}, r"num_kv_shared_layers: must be an integer in \[0, 6\)"),
    ],
)
def test_configs_it_cannot_serve_are_refused_naming_the_field(change, message):
    _, _, text = TINY_MODELS["gemma4"]
    hf = transformers.Gemma4TextConfig(**{**COMMON, **text, **change})
    hf.architectures = ["Gemma4ForCausalLM"]
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(hf)


def test_heads_wider_than_the_gpu_kernels_are_tested_with_are_refused():
    """A head wider than a kernel set was tested with is refused at start-up, naming the layer
    and its geometry: on Hopper past 512 dims (Gemma 4's full layers run there), on Blackwell
    past 256; the CPU reference kernels take any head size."""
    wide, wider = (AttentionLayer(5, num_heads=8, num_kv_heads=1, head_dim=d, scaling=1.0) for d in (512, 1024))
    TRTLLMMHABackend(torch.device("cpu")).prepare([wider], 16)
    TRTLLMMHABackend(torch.device("cpu"), kernels=KERNEL_SETS["sm90"]).prepare([wide], 16)
    for name, layer in (("sm90", wider), ("sm100", wide)):
        backend = TRTLLMMHABackend(torch.device("cpu"), kernels=KERNEL_SETS[name])
        with pytest.raises(ValueError, match=f"layer 5 reads 1 KV heads of {layer.head_dim} \\(full attention\\)"):
            backend.prepare([layer], 16)
