"""Authenticated one-way messages from Spark tasks to the driver (progress and metrics).

A frame is ``b"SDL1" | length (4 bytes) | HMAC-SHA256(secret, body) | body``, the body a
JSON object of at most 1 MiB. The secret is made per fit on the driver and reaches the tasks
inside the task closure (Spark's own channel), never over this socket. The server binds to
the driver's address, drops any connection whose frame is malformed, too big or carries a
wrong MAC, and never unpickles anything.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import threading
import time
from collections.abc import Callable

__all__ = ["MAX_BODY", "MessageClient", "MessageServer", "accept_loop", "pack"]

MAGIC = b"SDL1"
MAX_BODY = 1 << 20
_HEAD = struct.Struct("!4sI32s")


def pack(secret: bytes, message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_BODY:
        raise ValueError(f"message of {len(body)} bytes exceeds {MAX_BODY}")
    return _HEAD.pack(MAGIC, len(body), hmac.new(secret, body, hashlib.sha256).digest()) + body


def _read_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def accept_loop(sock: socket.socket, stop: threading.Event,
                handle: Callable[[socket.socket], None]) -> None:
    """Accept connections on ``sock`` until ``stop`` is set or ``sock`` is closed, each handled
    by ``handle`` on a daemon thread of its own; ``sock``'s timeout is how soon ``stop`` is
    seen. The serving loop of the message channel and of the parameter server."""
    while not stop.is_set():
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


class MessageServer:
    """Receives authenticated messages on ``host`` (a free port) and calls ``on_message``."""

    def __init__(self, host: str, secret: bytes, on_message: Callable[[dict], None]):
        self.secret, self.on_message = secret, on_message
        self.rejected = 0                  # connections dropped for a bad frame or MAC
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.address = (host, self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="spark_dl-messages", daemon=True)
        self._thread.start()

    def _serve(self):
        accept_loop(self._sock, self._stop, self._handle)

    def _handle(self, conn: socket.socket):
        with conn:
            conn.settimeout(None)
            while not self._stop.is_set():
                head = _read_exact(conn, _HEAD.size)
                if head is None:
                    return
                magic, length, mac = _HEAD.unpack(head)
                if magic != MAGIC or length > MAX_BODY:
                    self.rejected += 1
                    return
                body = _read_exact(conn, length)
                if body is None or not hmac.compare_digest(
                        mac, hmac.new(self.secret, body, hashlib.sha256).digest()):
                    self.rejected += 1
                    return
                try:
                    message = json.loads(body)
                except ValueError:
                    self.rejected += 1
                    return
                with self._lock:
                    if self._stop.is_set():       # closed: the owner has moved on
                        return
                    self.on_message(message)

    def close(self):
        """Stop serving; when it returns, no ``on_message`` call is running or will run."""
        with self._lock:
            self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)


class MessageClient:
    """Sends messages to a MessageServer; best effort: a lost driver never stops training."""

    def __init__(self, address: tuple[str, int] | None, secret: bytes, timeout: float = 5.0):
        self.address, self.secret, self.timeout = address, secret, timeout
        self._sock: socket.socket | None = None
        self.failed = address is None

    def send(self, message: dict) -> bool:
        if self.failed:
            return False
        try:
            if self._sock is None:
                self._sock = socket.create_connection(tuple(self.address), timeout=self.timeout)
            self._sock.sendall(pack(self.secret, {"time": time.time(), **message}))
            return True
        except OSError:
            self.failed = True            # progress is a convenience; training goes on
            self.close()
            return False

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None
