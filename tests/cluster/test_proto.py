"""The checked-in generated gRPC code is what cluster/proto/generate.sh makes from the proto
(grpcio-tools 1.84), and proto3 defaults are explicit: an unset temperature is not greedy."""

import filecmp
import os
import re
import subprocess

import pytest

from cluster.proto.slidespec.v1 import generation_pb2 as pb
from cluster.protocol import MAX_FIELD_CHARS, InvalidRequest, parse_request, request_to_body

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATED = ["generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"]


def test_generated_code_is_up_to_date(tmp_path):
    subprocess.run([os.path.join(ROOT, "cluster", "proto", "generate.sh"), str(tmp_path)], check=True)
    for name in GENERATED:
        fresh = tmp_path / "cluster" / "proto" / "slidespec" / "v1" / name
        assert filecmp.cmp(fresh, os.path.join(ROOT, "cluster", "proto", "slidespec", "v1", name), shallow=False), name


def test_unset_sampling_fields_take_engine_defaults():
    body = request_to_body(pb.GenerateRequest(prompt_token_ids=[1, 2]))
    assert "sampling" not in body  # the engine's defaults: temperature 1.0, max_new_tokens 128, ...
    request = pb.GenerateRequest(prompt_token_ids=[1])
    request.sampling.temperature = 0.0
    assert request_to_body(request)["sampling"] == {"temperature": 0.0}


def test_an_unknown_field_is_named_but_a_huge_name_is_cut():
    with pytest.raises(InvalidRequest) as info:
        parse_request({"prompt": "a", "k" * 100_000: 1})
    message = str(info.value)
    assert message.startswith("k" * MAX_FIELD_CHARS + "...: unknown field") and len(message) < 2 * MAX_FIELD_CHARS
    with pytest.raises(InvalidRequest, match=r"^sampling\.colour: unknown field$"):
        parse_request({"prompt": "a", "sampling": {"colour": 1}})


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "a\ud800"}, "prompt"),
        ({"prompt": "a", "request_id": "\udfff"}, "request_id"),
        ({"prompt": "a", "session_id": "s\ud800"}, "session_id"),
        ({"prompt": "a", "sampling": {"stop": ["ok", "\ud83d"]}}, "sampling.stop[1]"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_its_field(body, field):
    """JSON can escape a surrogate half that no UTF-8 text holds; it is refused before the tokenizer."""
    with pytest.raises(InvalidRequest, match=rf"^{re.escape(field)}: not valid Unicode text"):
        parse_request(body)


def test_text_beyond_the_basic_plane_is_accepted():
    parsed = parse_request({"prompt": "caf\u00e9 \U0001f600", "sampling": {"stop": ["\U0001f600"]}})
    assert parsed.body.prompt == "café 😀" and parsed.stop == ["😀"]
