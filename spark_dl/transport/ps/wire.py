"""The parameter server's wire format: authenticated binary frames over TCP.

    frame  = header (72 bytes) + payload
    header = magic "SDPS" | op | dtype | steps | worker | shard | version | count | length | mac
    mac    = HMAC-SHA256(secret, nonce of the connection | sequence number | header fields)

The secret is made per fit on the driver and reaches the tasks in the task closure; the nonce
is the server's greeting to each connection, the sequence number counts the connection's
frames, so a peer without the secret cannot open a connection, nor send or replay a frame on
one. The MAC covers the header, not the payload: it authenticates the peer and fixes what a
frame is (op, shard, version, length), but an attacker on the network path between a task and
the driver could still alter a payload's values in flight, as it could gloo's all-reduce
traffic between replicas; such a network needs encryption underneath (an overlay, IPsec).
Payloads are raw arrays (float32, float64 or bfloat16 parameters and gradients, int64 for
control data), never pickled, and their length must equal what the op and shard imply, so a
frame claiming 10 GB is refused before a byte of it is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import socket
import struct
import time

import numpy as np
import torch

__all__ = ["DTYPES", "DTYPE_CODES", "HEADER_BYTES", "MAGIC", "OPS", "Conn", "Growing", "PSError",
           "recv_exact"]

MAGIC = b"SDPS"
OPS = {"hello": 1, "pull": 2, "push": 3, "bye": 4, "pushpull": 5, "key": 6, "buffers": 7,
       "momentum": 8,
       "ok": 10, "error": 11}
DTYPES = {0: torch.float32, 1: torch.float64, 2: torch.bfloat16, 3: torch.int64}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
_HEAD = struct.Struct("!4sBBHIIqqQ")          # without the MAC
HEADER_BYTES = _HEAD.size + 32


class PSError(RuntimeError):
    """The parameter server refused a request or the connection broke."""


def _mac(secret: bytes, nonce: bytes, seq: int, head: bytes) -> bytes:
    return hmac.new(secret, nonce + seq.to_bytes(8, "big") + head, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:n], n - got)
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return buf[:n]


class Conn:
    """One side of an authenticated connection: frames with MACs and sequence numbers."""

    def __init__(self, sock: socket.socket, secret: bytes, nonce: bytes):
        self.sock, self.secret, self.nonce = sock, secret, nonce
        self.send_seq = self.recv_seq = 0
        self.bytes_sent = self.bytes_received = 0
        self.worker: int | None = None           # bound by the hello (server side)
        self.sink = None        # (head, payload) -> None: who writes the frames, if not send
        self.momentum = 0.0     # server side, look-ahead: the momentum the peer reported

    def send(self, op: int, payload: torch.Tensor | np.ndarray | bytes | None = None, *,
             worker=0, shard=0, version=0, count=0, steps=0, code=0):
        if payload is None:
            data = b""
        elif isinstance(payload, bytes):
            data = payload
        elif isinstance(payload, torch.Tensor):
            code = DTYPE_CODES[payload.dtype]
            data = payload.contiguous().view(torch.uint8).numpy() if payload.dtype == \
                torch.bfloat16 else payload.contiguous().numpy()
        else:
            code, data = DTYPE_CODES[torch.int64], np.ascontiguousarray(payload, np.int64)
        view = memoryview(data).cast("B") if len(data) else b""
        head = _HEAD.pack(MAGIC, op, code, steps, worker, shard, version, count, len(view))
        head += _mac(self.secret, self.nonce, self.send_seq, head)
        self.send_seq += 1
        self.bytes_sent += HEADER_BYTES + len(view)
        if self.sink is not None:                     # the server's event loop writes it
            self.sink(head, view)
            return
        # one gather-write for header and payload: no small segment left for Nagle to hold
        sent = self.sock.sendmsg([head, view] if len(view) else [head])
        if sent < len(head):                          # a partial write: finish it
            self.sock.sendall(head[sent:])
            sent = len(head)
        if sent - len(head) < len(view):
            self.sock.sendall(view[sent - len(head):])

    def send_error(self, error: Exception) -> None:
        """Tell the peer why its connection ends (an error frame), if its socket still takes
        it; a peer already gone is no error of ours."""
        try:
            self.send(OPS["error"], str(error).encode()[:4000])
        except OSError:
            pass

    def close_after_error(self, seconds: float = 1.0, limit: int = 1 << 26) -> None:
        """Close after an error frame so that the peer gets to read it: no more is sent (the
        frame, then the end of the stream), and what the peer still sends (a pipelined frame
        to the next shard) is read and dropped until it closes, ``seconds`` pass or ``limit``
        bytes came. Closing at once with bytes unread would reset the connection, and the
        peer would see the reset, not the reason."""
        sock = self.sock
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(0.1)             # (blocking again, if the loop's socket)
            end, got = time.monotonic() + seconds, 0
            while time.monotonic() < end and got < limit:
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    break
                got += len(data)
        sock.close()

    def recv(self, max_payload: int, into: memoryview | None = None):
        """(op, dtype, steps, worker, shard, version, count, payload memoryview)."""
        fields = self.header(bytes(recv_exact(self.sock, HEADER_BYTES)), max_payload)
        length = fields[-1]
        if fields[0] == OPS["error"]:
            into = None
        if isinstance(into, Growing):
            into = into.get(length)
        payload = recv_exact(self.sock, length, into) if length else memoryview(b"")
        self.received(length)
        return (*fields[:-1], payload)

    def header(self, raw: bytes, max_payload: int) -> tuple:
        """The next frame's header checked (magic, MAC, dtype, length): (op, dtype, steps,
        worker, shard, version, count, payload length). Then read the payload and call
        ``received``."""
        head, mac = raw[:_HEAD.size], raw[_HEAD.size:]
        magic, op, code, steps, worker, shard, version, count, length = _HEAD.unpack(head)
        if magic != MAGIC:
            raise PSError("bad magic: not a spark_dl parameter-server frame")
        if op == OPS["error"]:
            max_payload = max(max_payload, 4096)
        if not hmac.compare_digest(mac, _mac(self.secret, self.nonce, self.recv_seq, head)):
            raise PSError("bad MAC: the peer does not know this fit's secret (or replayed a "
                          "frame)")
        if code not in DTYPES:
            raise PSError(f"unknown dtype code {code}")
        if length > max_payload:
            raise PSError(f"frame announces {length} payload bytes, more than the {max_payload} "
                          f"this request may carry")
        return op, code, steps, worker, shard, version, count, length

    def received(self, length: int) -> None:
        """A frame whose header ``header`` checked has arrived whole."""
        self.recv_seq += 1
        self.bytes_received += HEADER_BYTES + length


class Growing:
    """A receive buffer that grows to the largest frame seen (never beyond max_payload)."""

    def __init__(self):
        self.buf = memoryview(bytearray(0))

    def get(self, n: int) -> memoryview:
        if len(self.buf) < n:
            self.buf = memoryview(bytearray(n))
        return self.buf
