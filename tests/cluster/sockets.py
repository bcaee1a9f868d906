"""Which TCP sockets a process tree listens on, read from /proc (Linux): for tests that check
what a Ray cluster exposes."""

import ipaddress
import os
import socket

LISTEN = "0A"  # the TCP state in /proc/net/tcp{,6}


def descendants(pid: int) -> set[int]:
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


def listening() -> dict[str, tuple[str, int]]:
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


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:  # the process ended meanwhile
        return [""]


def sockets_of(pids: set[int]) -> dict[tuple[str, int], str]:
    """(address, port) -> the process name, for the listening TCP sockets the processes hold."""
    open_sockets, found = listening(), {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # the process ended meanwhile
            continue
        name = cmdline(pid)[0]
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = target[len("socket:[") : -1] if target.startswith("socket:[") else None
            if inode in open_sockets:
                found[open_sockets[inode]] = name
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback  # ::ffff:127.0.0.1 is an IPv6 socket's
