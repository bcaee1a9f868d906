"""Engine behaviour: bad input, KV accounting, admission control, phase timings, stop
conditions, streaming, text prompts and weight formats."""

import json
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ops import DEFAULT_MODEL
from tests.hf_models import WINDOW, add_tokenizer, make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams
from workers.memory.allocator import cdiv

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3"))
    make_tiny_model("gemma3", path)
    return path


@pytest.fixture(scope="module")
def engine(gemma3_dir):
    eng = Engine(model=gemma3_dir, page_size=4, max_total_tokens=2048, chunked_prefill_size=16, context_length=256)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize(
    "prompt, sampling, field",
    [
        ([], GREEDY, "prompt_token_ids"),
        ([1] * 256, GREEDY, "prompt_token_ids"),
        ([1, 999], GREEDY, "prompt_token_ids"),
        ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([1, 2], SamplingParams(max_new_tokens=-3), "max_new_tokens"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(top_k=-2), "top_k"),
        ([1, 2], SamplingParams(seed=-1), "seed"),
    ],
)
def test_bad_request_names_field_and_leaks_nothing(engine, prompt, sampling, field):
    before = engine.kv_stats()
    with pytest.raises(ValueError, match=field):
        engine.generate(prompt_token_ids=[[5, 6, 7], prompt], sampling=sampling)
    assert engine.kv_stats() == before
    engine.check_no_leak()
    assert not engine.has_unfinished()


@pytest.mark.parametrize("text, problem", [("ok \ud800", "not valid Unicode text"), (5, "must be text")])
def test_a_text_prompt_the_tokenizer_cannot_take_is_named(text, problem):
    eng = Engine(model=DEFAULT_MODEL)
    with pytest.raises(ValueError, match=rf"^prompts\[1\]: {problem}"):
        eng.generate(prompts=["fine", text], sampling=SamplingParams(max_new_tokens=1))
    eng.check_no_leak()


@pytest.mark.parametrize("ids", [None, 5, "12", b"12", 1.5])
def test_stop_token_ids_that_are_not_a_list_are_named(ids):
    if ids is None:  # none, as vLLM reads it
        assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
        return
    with pytest.raises(ValueError, match="^stop_token_ids: must be a list of token ids"):
        SamplingParams(stop_token_ids=ids)


def test_bad_model_directory(tmp_path, gemma3_dir):
    with pytest.raises(ValueError, match="model"):
        Engine(model=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="config.json"):
        Engine(model=str(tmp_path))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(gemma3_dir, "config.json"), no_weights)
    with pytest.raises(ValueError, match="safetensors"):
        Engine(model=str(no_weights))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    cfg = json.load(open(os.path.join(gemma3_dir, "config.json")))
    cfg["architectures"] = ["MysteryForCausalLM"]
    json.dump(cfg, open(unknown / "config.json", "w"))
    with pytest.raises(ValueError, match="architectures"):
        Engine(model=str(unknown))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"intermediate_size": "x2"},
            r"'model.layers.0.mlp.\w+_proj.weight' does not fit Gemma3ForCausalLM: checkpoint shape",
        ),
        (
            {"intermediate_size": "/2"},
            r"'model.layers.0.mlp.\w+_proj.weight' does not fit Gemma3ForCausalLM: checkpoint shape",
        ),
        ({"vocab_size": "/2"}, r"'model.embed_tokens.weight' does not fit .*checkpoint shape"),
        (None, "is not a readable safetensors file"),
    ],
)
def test_weights_that_do_not_fit_the_config_are_refused_naming_the_tensor(gemma3_dir, tmp_path, change, message):
    """A checkpoint smaller than its config failed inside a slice with no tensor named; a larger
    one sliced cleanly into wrong weights (halving the config's sizes loaded without an error)."""
    shutil.copytree(gemma3_dir, tmp_path / "model")
    cfg = json.load(open(os.path.join(gemma3_dir, "config.json")))
    if change is None:
        (tmp_path / "model" / "model.safetensors").write_bytes(b"not a safetensors file")
    else:
        ((field, how),) = change.items()
        cfg[field] = cfg[field] * 2 if how == "x2" else cfg[field] // 2
        json.dump(cfg, open(tmp_path / "model" / "config.json", "w"))
    with pytest.raises(ValueError, match=message):
        Engine(model=str(tmp_path / "model"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vocab_size": -5}, "vocab_size must be a positive integer, got -5"),  # was a negative tensor dimension
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),  # transformers' own check (layer_types)
        ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
        ({"intermediate_size": True}, "intermediate_size"),  # transformers' own type check
        ({"num_attention_heads": 0}, "not a usable config: ZeroDivisionError"),  # transformers' own check
        ({"hidden_size": "big"}, "not a usable config: StrictDataclassFieldValidationError"),
        (None, "not a usable config: OSError"),  # not JSON
    ],
)
def test_a_config_with_impossible_sizes_is_refused_naming_them(gemma3_dir, tmp_path, change, message):
    shutil.copytree(gemma3_dir, tmp_path / "model")
    cfg = json.load(open(os.path.join(gemma3_dir, "config.json")))
    with open(tmp_path / "model" / "config.json", "w") as f:
        f.write("not json" if change is None else json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message):
        Engine(model=str(tmp_path / "model"))


@pytest.mark.parametrize(
    "file, text, message",
    [
        ("generation_config.json", "not json", "generation_config.json cannot be read"),
        ("generation_config.json", '{"eos_token_id": "abc"}', "generation_config.json: eos_token_id"),  # int('abc')
        ("generation_config.json", '{"eos_token_id": [1, 2.5]}', "generation_config.json: eos_token_id"),  # was 2
        ("generation_config.json", '{"eos_token_id": -3}', "generation_config.json: eos_token_id"),  # never matched
        ("config.json", {"eos_token_id": [1, -3]}, "config.json: eos_token_id"),
    ],
)
def test_end_of_sequence_ids_that_are_not_token_ids_are_refused(gemma3_dir, tmp_path, file, text, message):
    shutil.copytree(gemma3_dir, tmp_path / "model")
    if isinstance(text, dict):
        text = json.dumps({**json.load(open(os.path.join(gemma3_dir, "config.json"))), **text})
    with open(tmp_path / "model" / file, "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match=message):
        Engine(model=str(tmp_path / "model"))
    with open(tmp_path / "model" / "generation_config.json", "w") as f:
        f.write('{"eos_token_id": [7, null, 3]}')
    if file == "generation_config.json":
        assert set(Engine(model=str(tmp_path / "model")).cfg.eos_token_ids) >= {3, 7}


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json"])
def test_a_broken_tokenizer_file_is_named(tmp_path, file):
    model_dir = str(tmp_path / "model")
    shutil.copytree(DEFAULT_MODEL, model_dir)
    with open(os.path.join(model_dir, file), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="model: the tokenizer files in .* cannot be loaded: JSONDecodeError"):
        Engine(model=model_dir)


@pytest.mark.parametrize("tokenizer_class", ["TokenizersBackend", "PreTrainedTokenizerFast"])
def test_the_tokenizer_is_the_one_autotokenizer_builds(tmp_path, tokenizer_class):
    """`load_tokenizer` builds the plain tokenizer.json class itself, by either of its names (no
    model configs, no torch): the tokenizer AutoTokenizer gives."""
    from transformers import AutoTokenizer

    from workers.tokenizer import load_tokenizer

    model_dir = str(tmp_path / "model")
    shutil.copytree(DEFAULT_MODEL, model_dir)
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    config = json.load(open(config_path))
    with open(config_path, "w") as f:
        json.dump({**config, "tokenizer_class": tokenizer_class}, f)
    ours, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert type(ours) is type(theirs)
    text = "def f(x):\n    return x  # caf\u00e9 <start_of_turn>"
    assert ours(text).input_ids == theirs(text).input_ids
    assert ours.decode(theirs(text).input_ids) == theirs.decode(theirs(text).input_ids)
    assert (ours.all_special_ids, ours.eos_token_id, ours.bos_token_id) == (
        theirs.all_special_ids,
        theirs.eos_token_id,
        theirs.bos_token_id,
    )
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


def test_bad_engine_arguments(gemma3_dir):
    for kwargs, field in [
        ({"context_length": 10**6}, "context_length: 1000000 is longer than the model's max_position_embeddings"),
        ({"page_size": 0}, "page_size"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"dtype": "int7"}, "dtype"),
        ({"attention_backend": "nope"}, "attention_backend"),
        ({"load_format": "pickle"}, "load_format"),
        ({"max_running_requests": 0}, "max_running_requests"),  # nothing could ever run
        ({"context_length": 0}, "context_length"),  # was read as "the model's"
        ({"context_length": 1}, "context_length"),  # no room for a new token
        ({"cuda_graph_max_batch_size": 0}, "cuda_graph_max_batch_size"),
        *([({"device": "cuda"}, "device: 'cuda', but torch sees no CUDA")] if not torch.cuda.is_available() else []),
    ]:
        with pytest.raises(ValueError, match=field):
            Engine(model=gemma3_dir, **kwargs)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_swa_pool_stays_within_window_plus_a_page(gemma3_dir, page_size):
    chunk = 6
    eng = Engine(model=gemma3_dir, page_size=page_size, max_total_tokens=4096, chunked_prefill_size=chunk)
    for prompt in random_prompts([3 * WINDOW, WINDOW + 1, 5]):
        eng.add_request(prompt, SamplingParams(max_new_tokens=4 * WINDOW + 3, temperature=0.0, ignore_eos=True))
    decode_bound = (cdiv(WINDOW, page_size) + 1) * page_size
    extend_bound = (cdiv(WINDOW - 1 + chunk, page_size) + 1) * page_size
    decode_steps = 0
    peak_full = 0
    while eng.has_unfinished():
        eng.step()
        stats = eng.kv_stats()
        swa_used = stats["swa_total"] - stats["swa_free"]
        peak_full = max(peak_full, stats["full_total"] - stats["full_free"])
        running = eng.scheduler.running
        assert swa_used <= len(running) * extend_bound
        if running and all(r.prefilled for r in running):
            decode_steps += 1
            assert swa_used <= len(running) * decode_bound, (
                f"SWA use {swa_used} over window+page for {len(running)} requests"
            )
    assert decode_steps >= 4 * WINDOW
    assert peak_full > 3 * decode_bound  # full slots keep growing while SWA slots are recycled
    eng.check_no_leak()


def test_requests_wait_when_kv_is_short(gemma3_dir):
    prompts = random_prompts([20, 9, 14, 30, 11], seed=3)
    roomy = Engine(model=gemma3_dir, page_size=4, max_total_tokens=4096)
    expected = [o.token_ids for o in roomy.generate(prompt_token_ids=prompts, sampling=GREEDY)]
    tight = Engine(model=gemma3_dir, page_size=4, max_total_tokens=96, chunked_prefill_size=8)
    for p in prompts:
        tight.add_request(p, GREEDY)
    saw_waiting = False
    while tight.has_unfinished():
        saw_waiting |= bool(tight.scheduler.waiting)
        tight.step()
    assert saw_waiting, "the tight pool should have made some requests wait"
    assert [tight.output(f"req-{i}").token_ids for i in range(len(prompts))] == expected
    tight.check_no_leak()


def test_outputs_time_the_wait_for_admission_and_the_prefill(gemma3_dir):
    """One request runs at a time: the second waits in the queue until the first finished,
    which was after the first's prefill, so its queue time is at least that prefill time."""
    eng = Engine(model=gemma3_dir, page_size=4, max_total_tokens=2048, max_running_requests=1)
    first, second = [eng.add_request(p, GREEDY) for p in random_prompts([20, 9], seed=4)]
    phases = {}  # what each event reports: the times with a request's first tokens only
    while eng.has_unfinished():
        for rid, tokens, _ in eng.step():
            phases.setdefault(rid, []).append(eng.first_token_phases(rid, tokens))
    a, b = eng.output(first), eng.output(second)
    assert all(t is not None and t >= 0 for t in (a.queue_s, a.prefill_s, b.queue_s, b.prefill_s))
    assert b.queue_s >= a.prefill_s
    for rid, out in ((first, a), (second, b)):
        assert phases[rid][0] == (out.queue_s, out.prefill_s) and not any(phases[rid][1:]), phases[rid]
    eng.check_no_leak()


def test_request_larger_than_pool_is_rejected(gemma3_dir):
    # Without chunking a 40-token prompt needs its whole prefill in the SWA pool (13 pages of 4).
    eng = Engine(
        model=gemma3_dir, page_size=4, max_total_tokens=256, swa_full_tokens_ratio=0.1, chunked_prefill_size=None
    )
    with pytest.raises(ValueError, match="prompt_token_ids.*SWA"):
        eng.generate(prompt_token_ids=[[1] * 40], sampling=SamplingParams(max_new_tokens=10))
    eng.check_no_leak()
    (out,) = eng.generate(prompt_token_ids=[[1] * 12], sampling=SamplingParams(max_new_tokens=10))
    assert len(out.token_ids) <= 10
    eng.check_no_leak()


def test_stop_conditions(engine, gemma3_dir):
    prompt = random_prompts([13], seed=5)[0]
    (ref,) = engine.generate(prompt_token_ids=[prompt], sampling=GREEDY)
    assert ref.finish_reason == "length" and len(ref.token_ids) == GREEDY.max_new_tokens
    stop_at = next(i for i, t in enumerate(ref.token_ids) if i >= 3)
    stop_token = ref.token_ids[stop_at]
    first = ref.token_ids.index(stop_token)
    (out,) = engine.generate(
        prompt_token_ids=[prompt],
        sampling=SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_token,)),
    )
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1]

    cfg = json.load(open(os.path.join(gemma3_dir, "config.json")))
    eos_dir = os.path.join(os.path.dirname(gemma3_dir), "gemma3_eos")
    shutil.copytree(gemma3_dir, eos_dir, dirs_exist_ok=True)
    cfg["eos_token_id"] = stop_token
    json.dump(cfg, open(os.path.join(eos_dir, "config.json"), "w"))
    eos_engine = Engine(model=eos_dir, page_size=4, max_total_tokens=2048)
    (out,) = eos_engine.generate(prompt_token_ids=[prompt], sampling=SamplingParams(max_new_tokens=12, temperature=0.0))
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_token and len(out.token_ids) == first + 1
    (out,) = eos_engine.generate(prompt_token_ids=[prompt], sampling=GREEDY)
    assert out.token_ids == ref.token_ids  # ignore_eos

    short = Engine(model=gemma3_dir, page_size=4, max_total_tokens=2048, context_length=len(prompt) + 5)
    (out,) = short.generate(prompt_token_ids=[prompt], sampling=GREEDY)
    assert out.finish_reason == "length" and out.token_ids == ref.token_ids[:5]
    for eng in (engine, eos_engine, short):
        eng.check_no_leak()


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    prompts = random_prompts([10, 21], seed=7)
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = engine.generate(prompt_token_ids=[prompts[0]], sampling=sp)[0].token_ids
    batched = engine.generate(prompt_token_ids=prompts, sampling=[sp, SamplingParams(max_new_tokens=10, seed=99)])[
        0
    ].token_ids
    assert alone == batched
    other = engine.generate(
        prompt_token_ids=[prompts[0]],
        sampling=SamplingParams(max_new_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=4321),
    )[0].token_ids
    assert other != alone
    top1 = engine.generate(prompt_token_ids=[prompts[0]], sampling=SamplingParams(max_new_tokens=10, top_k=1, seed=5))[
        0
    ]
    greedy = engine.generate(
        prompt_token_ids=[prompts[0]], sampling=SamplingParams(max_new_tokens=10, temperature=0.0)
    )[0]
    assert top1.token_ids == greedy.token_ids
    engine.check_no_leak()


def test_stream_yields_generate_tokens_and_close_frees_kv(engine):
    prompt = random_prompts([19], seed=9)[0]
    (ref,) = engine.generate(prompt_token_ids=[prompt], sampling=GREEDY)
    streamed = [t for delta in engine.stream(prompt_token_ids=prompt, sampling=GREEDY) for t in delta]
    assert streamed == ref.token_ids
    it = engine.stream(prompt_token_ids=prompt, sampling=GREEDY)
    next(it)
    assert engine.kv_stats()["full_free"] < engine.kv_stats()["full_total"]
    it.close()
    engine.check_no_leak()


def test_abort_frees_kv(engine):
    rid = engine.add_request(random_prompts([30])[0], GREEDY)
    engine.step()
    engine.step()
    assert engine.abort(rid)
    assert engine.output(rid).finish_reason == "abort"
    engine.release(rid)
    assert not engine.abort(rid)
    engine.check_no_leak()


def test_text_prompts_with_tokenizer(gemma3_dir, tmp_path):
    model_dir = str(tmp_path / "with_tok")
    shutil.copytree(gemma3_dir, model_dir)
    add_tokenizer(model_dir)
    eng = Engine(model=model_dir, page_size=4, max_total_tokens=2048)
    tok = eng.tokenizer
    (by_text,) = eng.generate(prompts=["the quick brown fox"], sampling=GREEDY)
    (by_ids,) = eng.generate(prompt_token_ids=[tok.encode("the quick brown fox")], sampling=GREEDY)
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == tok.decode(by_ids.token_ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="prompts"):
        eng.generate(prompts=[""], sampling=GREEDY)
    eng.check_no_leak()


def test_sharded_checkpoint_and_dummy_weights(tmp_path):
    single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
    model = make_tiny_model("gemma3", single)
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    prompt = random_prompts([12])[0]
    a = Engine(model=single, page_size=4).generate(prompt_token_ids=[prompt], sampling=GREEDY)[0].token_ids
    b = Engine(model=sharded, page_size=4).generate(prompt_token_ids=[prompt], sampling=GREEDY)[0].token_ids
    assert a == b
    config_only = str(tmp_path / "config_only")
    os.makedirs(config_only)
    shutil.copy(os.path.join(single, "config.json"), config_only)
    dummy = Engine(model=config_only, page_size=4, load_format="dummy")
    (out,) = dummy.generate(prompt_token_ids=[prompt], sampling=GREEDY)
    assert len(out.token_ids) == GREEDY.max_new_tokens
    dummy.check_no_leak()
    w = dummy.runner.model.model.layers[0].self_attn.qkv_proj.weight
    assert 0.5 * 0.08 < w.std().item() < 2 * 0.08  # initializer_range of the config


def test_missing_weights_are_named(tmp_path):
    path = str(tmp_path / "m")
    make_tiny_model("llama", path)
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj|qkv_proj"):
        Engine(model=path)


@pytest.mark.parametrize(
    "index, message",
    [
        ("{not json", "is not a safetensors index"),
        ('{"metadata": {}}', "is not a safetensors index"),
        ('{"weight_map": ["a"]}', "is not a safetensors index"),
        ('{"weight_map": {}}', "weight_map must map"),
        ('{"weight_map": {"lm_head.weight": 3}}', "weight_map must map"),
        ('{"weight_map": {"lm_head.weight": "absent.safetensors"}}', "missing shards"),
    ],
)
def test_a_broken_safetensors_index_is_named(tmp_path, index, message):
    path = str(tmp_path / "m")
    make_tiny_model("llama", path)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write(index)
    with pytest.raises(ValueError, match=f"model: .*{message}"):
        Engine(model=path)


@pytest.mark.parametrize(
    "deltas, stops, sent, stopped",
    [
        (["def f", "(x):\n    ret", "urn x"], ["return"], ["def f", "(x):\n    ", ""], True),  # stop across deltas
        (["abc", "de"], ["xyz"], ["abc", "de"], False),
        (["ab", "x", "y"], ["xyz"], ["ab", "", "xy"], False),  # "xy" held back, then flushed at the end
        (["time", ", sys"], ["e, "], ["tim", ""], True),  # held back "e" was the start of the stop
    ],
)
def test_stop_strings_cut_before_the_stop(deltas, stops, sent, stopped):
    from workers.tokenizer import StopStrings

    filt = StopStrings(stops)
    out = [filt.add(d, final=i == len(deltas) - 1) for i, d in enumerate(deltas)]
    assert out == sent and filt.stopped == stopped


def _first_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Reference: the text before the stop string whose first occurrence ends earliest (the first
    listed among those ending at the same place)."""
    best = None
    for i, s in enumerate(stops):
        at = text.find(s)
        if at != -1 and (best is None or (at + len(s), i) < best[0]):
            best = ((at + len(s), i), at)
    return (text, False) if best is None else (text[: best[1]], True)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=40),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=5), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_streamed_stop_strings_match_the_whole_text_reference(text, stops, cuts):
    """However the text is split into deltas, what is sent is the reference cut, and nothing
    sent can later turn out to belong to a stop string."""
    from workers.tokenizer import StopStrings

    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    filt = StopStrings(stops)
    sent = "".join(filt.add(d, final=i == len(deltas) - 1) for i, d in enumerate(deltas))
    assert (sent, filt.stopped) == _first_stop(text, stops)
