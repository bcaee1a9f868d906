"""A head started the documented way (`ops/ray_loopback_head.sh`) keeps every Ray process on
loopback: with Serve started on it (controller and proxy actors: worker processes), every TCP
socket that any of the head's processes listens on is bound to a loopback address, and none
answers on this machine's other addresses. Ray 2.60 binds to every interface (or the machine's
address) as soon as the node IP is not 127.0.0.1, so a wildcard socket fails the first check
even on a machine with no interface but loopback."""

import fcntl
import ipaddress
import socket
import struct

import pytest

from tests.cluster.conftest import free_port
from tests.cluster.ray_head import LOOPBACK_ENV, Head, run_cli
from tests.cluster.sockets import cmdline, descendants, is_loopback, listening, sockets_of

SIOCGIFADDR = 0x8915


@pytest.fixture(scope="module")
def head():
    head = Head(num_cpus=1)
    try:
        head.wait_up()
        started = run_cli(
            "serve",
            "start",
            "-a",
            head.gcs_address,
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(free_port()),
            env=head.env,
        )
        assert started.returncode == 0, started.stdout + started.stderr
        yield head
        head.shutdown_serve()
    finally:
        head.stop()


def _other_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                found.append(address)
    return found


def test_every_ray_process_listens_on_loopback_only(head):
    sockets = sockets_of(descendants(head.process.pid))
    ports = {port for _, port in sockets}
    gcs, dashboard = int(head.gcs_address.rsplit(":", 1)[1]), int(head.address.rsplit(":", 1)[1])
    assert {gcs, dashboard} <= ports, sockets  # the scan sees the head's own sockets
    names = set(sockets.values())
    assert any(n.endswith("/raylet") for n in names) and any(n.startswith("ray::ServeController") for n in names), names
    wide = {f"{address}:{port}": name for (address, port), name in sockets.items() if not is_loopback(address)}
    assert not wide, f"listening beyond loopback: {wide}"
    # nothing answers on this machine's other addresses (ports some other process holds there aside)
    elsewhere = {port for address, port in listening().values() if not is_loopback(address)}
    for address in _other_addresses():
        for port in ports - elsewhere:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, port), timeout=2).close()


def test_ray_and_serve_place_the_node_on_loopback(head):
    """The node's IP is 127.0.0.1 (`ray start` would otherwise replace it with the machine's);
    the Serve CLI's dashboard commands need only the token, not the head's loopback setting."""
    assert head.serve_controller()["node_ip"] == "127.0.0.1"
    token_only = {k: v for k, v in head.env.items() if k not in LOOPBACK_ENV}
    status = run_cli("serve", "status", "-a", head.address, env=token_only)
    assert status.returncode == 0 and "proxies" in status.stdout, status.stdout + status.stderr
    (gcs,) = [cmdline(p) for p in descendants(head.process.pid) if cmdline(p)[0].endswith("/gcs_server")]
    assert "--node-ip-address=127.0.0.1" in gcs
