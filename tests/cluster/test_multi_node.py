"""A tensor-parallel replica whose two ranks run on two Ray nodes (Ray's multi-node test cluster:
two raylets on this machine, each with its own CPUs; placement strategy SPREAD). Its greedy
output equals one in-process engine's; removing the node that holds a rank ends the request in
flight promptly with UNAVAILABLE, and once a node joins again the replica is back. The ingress
(on the head) streams from rank 0 over its Unix socket only where rank 0 is on the head too."""

import time

import grpc
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from cluster.app import build_app
from cluster.client import GenerationClient
from cluster.proto.slidespec.v1 import generation_pb2 as pb
from ops import DEFAULT_MODEL
from tests.cluster.conftest import free_port, stop_shared_ray
from workers.engine import Engine, SamplingParams

PROMPT = [5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 1, 4]


@pytest.fixture(scope="module")
def cluster():
    stop_shared_ray()  # this process connects to the multi-node cluster instead
    # Every node listens on loopback only; keep the driver from swapping 127.0.0.1 for this
    # machine's external address when it connects (Ray does so to reach remote nodes).
    patch = pytest.MonkeyPatch()
    patch.setattr(ray._private.services, "resolve_ip_for_localhost", lambda host: host)
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    # The head takes the ingress, the replica actor and one rank; the worker room for one rank.
    worker = c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=c.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    yield c, worker
    serve.shutdown()
    ray.shutdown()
    c.shutdown()
    patch.undo()


def _pings() -> dict[int, dict]:
    """Rank -> its ping (the node it runs on, its socket's callers), asked of the rank actors."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("slidespec-multi-")]
    pings = ray.get([ray.get_actor(a["name"], a["namespace"]).ping.remote() for a in names])
    return {p["rank"]: p for p in pings}


def test_ranks_on_two_nodes_and_a_node_lost(cluster):
    c, worker = cluster
    args = dict(
        model=DEFAULT_MODEL,
        tp_size=2,
        placement_strategy="SPREAD",
        cpus_per_rank=1,
        replica_cpus=0.25,
        ingress_cpus=0.25,
        page_size=16,
        max_total_tokens=2048,
        health_check_period_s=0.5,
        grpc={"port": 0},
    )
    handle = serve.run(build_app(args), name="multi", route_prefix=None)
    client = GenerationClient(f"127.0.0.1:{handle.ports.remote().result()['grpc']}")
    nodes = {rank: p["node_id"] for rank, p in _pings().items()}
    assert set(nodes.values()) == {c.head_node.node_id, worker.node_id}, f"ranks on nodes {nodes}: not spread"

    greedy = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = Engine(model=DEFAULT_MODEL, page_size=16, max_total_tokens=2048).generate(
        prompt_token_ids=[PROMPT], sampling=SamplingParams(**greedy)
    )
    got = [t for r in client.generate(PROMPT, **greedy) for t in r.token_ids]
    assert got == want[0].token_ids
    socket_callers = _pings()[0]["socket_callers"]
    assert bool(socket_callers) == (nodes[0] == c.head_node.node_id), (nodes, socket_callers)  # else through Ray

    stream = client.generate(PROMPT, max_new_tokens=2000, temperature=0.0, ignore_eos=True)
    assert next(stream).token_ids  # in flight
    c.remove_node(worker, allow_graceful=False)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as failed:
        for _ in stream:
            pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 30, "the request in flight hung"

    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")  # room for the replica's second rank again
    deadline = time.monotonic() + 180
    while True:
        try:
            last = list(client.generate(PROMPT, **greedy))[-1]
            break
        except grpc.RpcError as exc:
            assert time.monotonic() < deadline, f"the replica did not come back: {exc.code()}"
            time.sleep(1)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    client.close()
