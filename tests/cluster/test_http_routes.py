"""The HTTP surface is exactly the route table: each entry answers its method and nothing else,
a path nobody defined is 404 (OpenAI's error shape under /v1) and a defined path with another
method 405 with `Allow`; random paths and methods never get a 200 outside the table; `/health`
is 200 with a serving replica and 503 without one; the checks third-party clients make on
connecting (guidellm's `GET <base>/health`, `GET /v1/models`) pass."""

import importlib.metadata
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import requests
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from ray import serve

from cluster.app import build_app
from cluster.http_routes import ROUTES, match, relative_path
from cluster.rank_actor import rank0_replica
from ops import DEFAULT_MODEL

MODEL = "tiny-gemma3"
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
# a body each POST route accepts (so that "answers its method" means a real answer)
BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "def f(x):", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/generate": {"prompt": "def f(x):", "sampling": {"max_new_tokens": 2}, "stream": False},
}


def _concrete(path: str) -> str:
    return path.replace("{model}", MODEL)


# -- the table alone ------------------------------------------------------------------------------
def test_every_entry_matches_its_own_method_and_path_only():
    for route in ROUTES:
        path = _concrete(route.path)
        assert match(route.method, path).route is route
        for method in METHODS:
            if method != route.method:
                found = match(method, path)
                assert found.route is None and found.status == 405 and route.method in found.allowed
    for path in (
        "/",
        "/v1",
        "/v1/embeddings",
        "/v1/responses",
        "/generate/v1/embeddings",
        "/v1/models/a/b",
        "/V1/models",
    ):
        assert match("POST", path).status == 404 and match("GET", path).status == 404
    assert match("GET", "/v1/nope").errors == "openai" and match("GET", "/nope").errors == "generate"


@pytest.mark.parametrize(
    "path, root, relative",
    [
        ("/v1/models", "", "/v1/models"),
        ("/v1/models/", "", "/v1/models"),
        ("/app/v1/models", "/app", "/v1/models"),
        ("/app", "/app", "/"),
        ("/apple/v1/models", "/app", "/apple/v1/models"),  # another prefix that starts the same
        ("/", "", "/"),
    ],
)
def test_paths_are_taken_below_the_route_prefix(path, root, relative):
    assert relative_path(path, root) == relative


# -- a running application at the root prefix -------------------------------------------------------
@pytest.fixture(scope="module")
def base(ray_serve):
    args = dict(
        model=DEFAULT_MODEL,
        page_size=4,
        max_total_tokens=2048,
        context_length=256,
        num_replicas=1,
        health_check_period_s=1.0,
        grpc={"port": 0},
    )
    serve.run(build_app(args), name="routes", route_prefix="/")
    yield ray_serve


def _send(base: str, method: str, path: str) -> requests.Response:
    body = BODIES.get(path) if method == "POST" else None
    return requests.request(method, f"{base}{path}", json=body, timeout=60)


def test_each_entry_answers_its_method_and_refuses_the_others(base):
    for route in ROUTES:
        path = _concrete(route.path)
        r = _send(base, route.method, path)
        assert r.status_code == 200, (route, r.text[:300])
        for method in METHODS:
            if method == route.method:
                continue
            r = _send(base, method, path)
            assert r.status_code == 405, (method, path, r.status_code, r.text[:200])
            assert r.headers["Allow"] == route.method
            if method != "HEAD":
                error = r.json()["error"]
                assert route.method in error["message"] and path in error["message"]


def test_unknown_paths_are_404_in_the_shape_of_their_api(base):
    r = requests.post(f"{base}/v1/embeddings", json={"model": MODEL, "input": "x"}, timeout=30)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    r = requests.post(f"{base}/v1/responses", json={"model": MODEL, "input": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    r = requests.post(f"{base}/generate/v1/embeddings", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND", r.text
    r = requests.get(f"{base}/v1/models/another-model", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


SEGMENTS = st.sampled_from(["v1", "generate", "metrics", "health", "version", "models", "completions", "chat", "x", ""])
PATHS = st.one_of(
    st.lists(SEGMENTS, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts)),
    st.text(st.characters(codec="ascii", exclude_characters="?#%"), max_size=24).map(lambda t: "/" + t.lstrip("/")),
)


def _drawn(count: int) -> list[tuple[str, str]]:
    """`count` (method, path) pairs drawn by hypothesis under a fixed seed."""
    cases: list[tuple[str, str]] = []

    @seed(20261126)
    @settings(max_examples=count, database=None, suppress_health_check=list(HealthCheck), deadline=None)
    @given(st.sampled_from(METHODS), PATHS)
    def draw(method, path):
        cases.append((method, path))

    draw()
    return cases


def test_random_paths_and_methods_get_no_200_outside_the_table(base):
    def outcome(case: tuple[str, str]) -> tuple[str, str, int]:
        method, path = case
        r = requests.request(method, f"{base}{path}", json={"prompt": "x"}, timeout=60)
        return method, path, r.status_code

    cases = _drawn(400)
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(outcome, cases))
    for method, path, status in outcomes:
        routed = match(method, relative_path(requests.Request(method, f"{base}{path}").prepare().path_url, ""))
        if routed.route is None:
            assert status in (404, 405), (method, path, status)
        else:  # inside the table a 200 is allowed, never a server error
            assert status < 500, (method, path, status)
    assert sum(status == 404 for *_, status in outcomes) > 100  # the draw did reach unknown paths


def test_version_and_what_clients_check_on_connecting(base):
    assert requests.get(f"{base}/version", timeout=30).json() == {"version": importlib.metadata.version("slidespec")}
    # guidellm's backend check: the target without /v1, GET <target>/health, then the models
    target = f"{base}/v1".rstrip("/").removesuffix("/v1")
    headers = {"Authorization": "Bearer anything"}
    assert requests.get(f"{target}/health", headers=headers, timeout=30).status_code == 200
    models = requests.get(f"{target}/v1/models", headers=headers, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert requests.get(f"{target}/v1/models/{MODEL}", timeout=30).json()["id"] == MODEL


def _health(base: str) -> int:
    return requests.get(f"{base}/health", timeout=30).status_code


def _wait_for(base: str, status: int, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while (seen := _health(base)) != status:
        assert time.monotonic() < deadline, f"/health stayed {seen}, expected {status}"
        time.sleep(0.2)


def test_health_is_503_while_no_replica_can_serve_and_200_once_one_can(base):
    assert _health(base) == 200
    named = ray.util.list_named_actors(all_namespaces=True)
    rank0 = [a for a in named if rank0_replica("routes", a["name"]) is not None]
    assert len(rank0) == 1, named
    ray.kill(ray.get_actor(rank0[0]["name"], namespace=rank0[0]["namespace"]), no_restart=True)
    _wait_for(base, 503, 30)  # the replica's rank 0 is gone
    body = requests.get(f"{base}/health", timeout=30).json()
    assert body["status"] == "unavailable" and body["replicas"] == 0
    _wait_for(base, 200, 120)  # Serve replaced the replica
