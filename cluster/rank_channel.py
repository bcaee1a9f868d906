"""The same-node data plane between rank 0 and its callers: one Unix socket connection a caller.

Why not Ray on the hot path: an actor call in and a streaming-generator item out cost about a
millisecond each, and both run on rank 0's event loop, which waits for the interpreter lock
while the loop thread runs the next step. Over a socket, the loop thread writes each step's item
itself (one pickle, one `sendall`) and a thread per connection reads submits and aborts; rank 0's
event loop is not on the path. Ray stays the control plane (placement, health, drain, the
address and secret of this socket), and callers on another node stream through Ray.

Wire: the secret rank 0 handed out through Ray (raw bytes, checked before anything is
unpickled; a connection without it is closed), then frames of a 4-byte big-endian length and a
pickle. The socket lives in a directory only this user can enter.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import pickle
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!I")
SEND_TIMEOUT_S = 5.0  # a caller that reads nothing for this long is cut off (its requests aborted)
SEND_BUFFER_BYTES = 4 << 20  # asked for; the kernel caps it (net.core.wmem_max): tens of busy steps


def frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None at end of stream."""
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> Any:
    """The next message, or None when the peer closed the connection."""
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    body = _recv_exactly(sock, HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The next message; raises `asyncio.IncompleteReadError` when the peer closed."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


class Connection:
    """Rank 0's end of one caller's connection. `send` is called by the loop thread (each step's
    item) and by the connection's reader (refusals); it never raises: a connection that cannot
    take an item within `SEND_TIMEOUT_S` is shut down, and its reader then ends it."""

    def __init__(self, sock: socket.socket, reader: str) -> None:
        self.sock = sock
        self.reader = reader
        self.closed = False
        self._send_lock = threading.Lock()

    def send(self, item: dict[str, Any]) -> None:
        data = frame(item)
        with self._send_lock:
            if self.closed:
                return
            try:
                self.sock.sendall(data)
            except OSError as exc:
                logger.warning("caller %s: cannot take updates (%s); closing its connection", self.reader, exc)
                self.shut()

    def shut(self) -> None:
        """Mark closed and wake the reader thread (which then ends the connection)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Release the socket, never under a send in progress (its descriptor could be reused)."""
        self.shut()
        with self._send_lock:
            self.sock.close()

    def __repr__(self) -> str:
        return f"Connection({self.reader!r})"


class ChannelServer:
    """Rank 0's listening socket. `on_message(connection, message)` runs on the connection's
    reader thread for each message after the secret; `on_close(connection)` once when it ends."""

    def __init__(
        self,
        on_message: Callable[[Connection, Any], None],
        on_close: Callable[[Connection], None],
    ) -> None:
        self.on_message = on_message
        self.on_close = on_close
        self.secret = secrets.token_bytes(32)
        self._dir = tempfile.mkdtemp(prefix="slidespec-rank0-")  # mode 0700: only this user gets in
        self.path = os.path.join(self._dir, "rank0.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self.connections: set[Connection] = set()
        self._closing = False
        threading.Thread(target=self._accept, name="rank0-channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            threading.Thread(target=self._serve, args=(sock,), name="rank0-channel-conn", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        """One connection: check its secret, then hand each message to `on_message` until it ends."""
        sock.settimeout(SEND_TIMEOUT_S)  # bounds the handshake
        try:
            secret = _recv_exactly(sock, len(self.secret))
            hello = recv_message(sock) if secret is not None and hmac.compare_digest(secret, self.secret) else None
        except (OSError, pickle.UnpicklingError, EOFError) as exc:
            logger.warning("rank 0 channel: a connection failed its handshake: %s", exc)
            hello = None
        if not isinstance(hello, dict):
            logger.warning("rank 0 channel: a connection without the secret was refused")
            sock.close()
            return
        sock.settimeout(None)  # reads wait for the caller; sends are bounded below
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        seconds, fraction = divmod(SEND_TIMEOUT_S, 1.0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), int(fraction * 1e6)))
        conn = Connection(sock, str(hello.get("reader", "?")))
        self.connections.add(conn)
        try:
            while True:
                message = recv_message(sock)
                if message is None:
                    break
                self.on_message(conn, message)
        except (OSError, pickle.UnpicklingError, EOFError) as exc:
            if not conn.closed:
                logger.warning("rank 0 channel: caller %s's connection broke: %s", conn.reader, exc)
        finally:
            conn.close()
            self.connections.discard(conn)
            self.on_close(conn)

    def close(self) -> None:
        """Stop listening and end every connection (their callers fail what still waits)."""
        self._closing = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()
        for conn in list(self.connections):
            conn.shut()
        shutil.rmtree(self._dir, ignore_errors=True)


class ChannelClient:
    """A caller's end: `submit` and `abort` write at once (in order), `run` hands out every item
    until the connection ends."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def connect(cls, path: str, secret: bytes, name: str) -> ChannelClient:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(secret + frame({"reader": name}))
        await writer.drain()
        return cls(reader, writer)

    def send(self, message: tuple) -> None:
        if not self._writer.is_closing():
            self._writer.write(frame(message))

    async def run(self, deliver: Callable[[dict[str, Any]], None]) -> None:
        """Deliver each item; returns when rank 0 closed the connection (it stopped or died)."""
        try:
            while True:
                deliver(await read_message(self._reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    def close(self) -> None:
        self._writer.close()
