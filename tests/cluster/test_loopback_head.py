"""A head started the documented way (`ops/ray_loopback_head.sh`) keeps every Ray process on
loopback: with Serve started on it (controller and proxy actors: worker processes), every TCP
socket that any of the head's processes listens on is bound to a loopback address, and none
answers on this machine's other addresses. Ray 2.60 binds to every interface (or the machine's
address) as soon as the node IP is not 127.0.0.1, so a wildcard socket fails the first check
even on a machine with no interface but loopback."""

import fcntl
import ipaddress
import os
import socket
import struct

import pytest

from tests.cluster.conftest import free_port
from tests.cluster.ray_head import LOOPBACK_ENV, Head, run_cli

LISTEN = "0A"  # the TCP state in /proc/net/tcp{,6}
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


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo += children.get(p, [])
    return found


def _listening() -> dict[str, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket of this machine."""
    sockets = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != LISTEN:
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                sockets[fields[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    return sockets


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:  # the process ended meanwhile
        return [""]


def _sockets_of(pids: set[int]) -> dict[tuple[str, int], str]:
    """(address, port) -> the process name, for the listening TCP sockets the processes hold."""
    listening, found = _listening(), {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # the process ended meanwhile
            continue
        name = _cmdline(pid)[0]
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = target[len("socket:[") : -1] if target.startswith("socket:[") else None
            if inode in listening:
                found[listening[inode]] = name
    return found


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback  # ::ffff:127.0.0.1 is an IPv6 socket's


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
    sockets = _sockets_of(_descendants(head.process.pid))
    ports = {port for _, port in sockets}
    gcs, dashboard = int(head.gcs_address.rsplit(":", 1)[1]), int(head.address.rsplit(":", 1)[1])
    assert {gcs, dashboard} <= ports, sockets  # the scan sees the head's own sockets
    names = set(sockets.values())
    assert any(n.endswith("/raylet") for n in names) and any(n.startswith("ray::ServeController") for n in names), names
    wide = {f"{address}:{port}": name for (address, port), name in sockets.items() if not _is_loopback(address)}
    assert not wide, f"listening beyond loopback: {wide}"
    # nothing answers on this machine's other addresses (ports some other process holds there aside)
    elsewhere = {port for address, port in _listening().values() if not _is_loopback(address)}
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
    (gcs,) = [_cmdline(p) for p in _descendants(head.process.pid) if _cmdline(p)[0].endswith("/gcs_server")]
    assert "--node-ip-address=127.0.0.1" in gcs
