"""A worker's connection to the parameter server (server.py), one request at a time, in the
frames of wire.py."""

from __future__ import annotations

import socket
import time

import numpy as np
import torch

from .wire import DTYPE_CODES, OPS, Conn, PSError, recv_exact

__all__ = ["PSClient"]


class PSClient:
    """A worker's connection to the parameter server (one request at a time)."""

    def __init__(self, address, secret: bytes, worker: int, dtype: torch.dtype = torch.float32,
                 timeout_s: float = 300.0):
        self.worker, self.dtype = worker, dtype
        sock = socket.create_connection(tuple(address), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = bytes(recv_exact(sock, 16))
        self.conn = Conn(sock, secret, nonce)
        self.bounds: list[int] = []
        self.versions: list[int] = []
        self.trained = 0                 # mini-batches pushed by this client (buffers' weight)
        self.done_steps = 0                       # set by hello
        self.shard_done: list[int] = []           # set by hello: per shard
        self._skip: list[int] = []                # steps whose push a shard already has
        self.push_seconds = self.pull_seconds = 0.0
        self.newer_asks = 0                       # pull_newer calls
        self.board = None                         # the server's versions, on this machine
        self.board_skips = 0                      # pull_newer calls the board answered
        self.momentum = 0.0       # of its next pushes, as the server has it (look-ahead)
        self._key_asked = False   # a key request is out, its reply after the push's (push)

    def _reply(self, max_payload: int, into=None):
        op, code, _steps, _worker, shard, version, count, payload = self.conn.recv(max_payload,
                                                                                   into)
        if op == OPS["error"]:
            raise PSError("parameter server: " + bytes(payload).decode(errors="replace"))
        return code, shard, version, count, payload

    def hello(self, rows: int, batch_size: int, shards: list[int] | None = None,
              profile: tuple[float, float, int] | None = None) -> int:
        """Register; returns the steps per epoch (sync: those of the largest shard). Sets
        ``shard_done``: per shard, the mini-batch steps of this worker id the server already
        has (a retried task's earlier attempts), and ``done_steps``, the least of them over
        the ``shards`` this worker pushes to (default: all), where a retried worker goes on
        from. A task killed between the shards of one push left that step on some shards
        only: the push that redoes it skips those shards, so that no shard counts a step
        twice and, in sync mode, the round the dead task left open is closed. ``profile``:
        this worker's step time t(b) = a + c b (seconds) and memory cap (rows), for balanced
        sync rounds: ``batch`` is then this worker's share of the global batch."""
        values = [rows, batch_size]
        if profile is not None:
            values += [round(profile[0] * 1e12), round(profile[1] * 1e12), int(profile[2])]
        self.conn.send(OPS["hello"], np.array(values, np.int64), worker=self.worker)
        _, _, _, numel, payload = self._reply(1 << 20)
        info = np.frombuffer(payload, np.int64)
        k = (len(info) - 3) // 2                 # bounds (k + 1), done (k), steps, batch
        self.bounds = [int(b) for b in info[:k + 1]]
        self.shard_done = [int(d) for d in info[k + 1:2 * k + 1]]
        mine = range(k) if shards is None else shards
        self.done_steps = min(self.shard_done[i] for i in mine)
        self._skip = [self.shard_done[i] - self.done_steps if i in mine else 0
                      for i in range(k)]
        self.versions = [0] * k
        self.numel = numel
        self.batch = int(info[-1])
        return int(info[-2])

    def next_key(self) -> tuple[str, int, int]:
        """Data keys: ("key", key, epoch), ("wait", milliseconds, 0) or ("finished", 0, 0).
        The request went out already when the last push asked for it (``push(ask_key=)``)."""
        if not self._key_asked:
            self.conn.send(OPS["key"], worker=self.worker)
        self._key_asked = False
        _, _, _, _, payload = self._reply(24)
        status, a, b = (int(v) for v in np.frombuffer(payload, np.int64))
        return ("key", "wait", "finished")[status], a, b

    def _no_key_out(self, what: str) -> None:
        """A key request sent behind a push is answered first: its reply must be read (by
        ``next_key``) before anything else, or it would be taken for this request's."""
        if self._key_asked:
            raise RuntimeError(f"a {what} after push(ask_key=True): read the next key with "
                               f"next_key() first (its reply comes before any other)")

    def _layout(self, shards, n: int) -> list[tuple[int, int, int]]:
        """(shard, its size, its offset in the caller's buffer) for ``shards`` (None: all),
        whose buffer holds those shards one after the other (``n`` values)."""
        shards = range(len(self.versions)) if shards is None else shards
        rows, off = [], 0
        for i in shards:
            if not 0 <= i < len(self.versions):
                raise ValueError(f"shard {i} does not exist (0..{len(self.versions) - 1})")
            size = self.bounds[i + 1] - self.bounds[i]
            rows.append((i, size, off))
            off += size
        if off != n:
            raise ValueError(f"the buffer holds {n} values, the shards {list(shards)} {off}")
        return rows

    def pull(self, out: torch.Tensor, shards: list[int] | None = None) -> None:
        """The shards (default: all) into ``out``, flat, one after the other; remembers the
        versions. The requests go out together (they are small), the replies come in order."""
        self._pull(out, shards, newer=False)

    def watch(self, board) -> None:
        """Read the server's versions from ``board`` (a board.BoardReader, or None: ask)."""
        self.board = board

    def pull_newer(self, out: torch.Tensor, shards: list[int] | None = None
                   ) -> list[tuple[int, int]]:
        """As ``pull``, but a shard still at the version this worker holds comes back empty
        (a header, no values) and leaves its part of ``out`` as it was; returns the (offset,
        size) in ``out`` of the shards that had moved (empty: none). With a board
        (``watch``) that shows every shard at this worker's version, nothing is sent."""
        self.newer_asks += 1
        if self.board is not None:
            mine = range(len(self.versions)) if shards is None else shards
            if all(self.board.version(i) == self.versions[i] for i in mine):
                self.board_skips += 1
                return []
        return self._pull(out, shards, newer=True)

    def _pull(self, out: torch.Tensor, shards: list[int] | None, newer: bool
              ) -> list[tuple[int, int]]:
        self._no_key_out("pull")
        t0 = time.perf_counter()
        rows = self._layout(shards, out.numel())
        for i, _, _ in rows:                  # steps=1: "only if newer than version"
            self.conn.send(OPS["pull"], worker=self.worker, shard=i, code=DTYPE_CODES[out.dtype],
                           version=self.versions[i] if newer else 0, steps=int(newer))
        moved = []
        for i, size, off in rows:
            if self._read_values(i, out[off:off + size], empty_ok=newer) is not None:
                moved.append((off, size))
        self.pull_seconds += time.perf_counter() - t0
        return moved

    def _read_values(self, i: int, out: torch.Tensor, empty_ok: bool = False) -> int | None:
        """Read shard i's values into ``out`` (its size); returns the reply's count, or None
        for an empty reply (an unchanged shard, allowed with ``empty_ok``)."""
        item, n = out.element_size(), out.numel()
        raw = memoryview(out.view(torch.uint8).numpy())
        _, shard, version, count, payload = self._reply(n * item, raw)
        if shard != i or len(payload) not in ((0, n * item) if empty_ok else (n * item,)):
            raise PSError(f"reply for shard {i}: shard {shard} with {len(payload)} bytes, "
                          f"expected {'0 or ' if empty_ok else ''}{n * item}")
        self.versions[i] = version
        return count if len(payload) or not empty_ok else None

    def report_buffers(self, values: torch.Tensor) -> None:
        """This worker's floating-point buffers (flat, NaN: not reported; see buffers.py)
        after the mini-batches it has pushed so far to the server, which keeps the latest and
        weights it by them: one frame, no reply (an error comes back as the reply to the next
        request). They travel in their own dtype, float32 or float64 (not the gradients'
        bfloat16: a running variance needs its digits)."""
        if values.dtype not in (torch.float32, torch.float64):
            values = values.float()
        self.conn.send(OPS["buffers"], values, worker=self.worker, count=self.trained)

    def report_momentum(self, momentum: float) -> None:
        """The momentum this worker's next pushes carry (staleness rule "dana": the server's
        look-ahead steps it), when it differs from the last one reported: one frame, no
        reply."""
        if momentum != self.momentum:
            self.conn.send(OPS["momentum"], torch.tensor([momentum], dtype=torch.float64),
                           worker=self.worker)
            self.momentum = momentum

    def push(self, grad_sum: torch.Tensor, samples: int, steps: int = 1,
             pull_into: torch.Tensor | None = None, shards: list[int] | None = None,
             versions: list[int] | None = None, buffers: torch.Tensor | None = None,
             momentum: float | None = None, ask_key: bool = False) -> list[int]:
        """Push the per-sample gradient sum of ``steps`` mini-batches (``samples`` in all) of
        the shards (default: all; ``grad_sum`` holds them one after the other); returns the
        staleness per shard. With ``pull_into`` (as ``grad_sum``, of the wire dtype) every
        shard's reply carries its values after the push: one round trip, not two.
        ``versions``: the shard versions the gradient was computed on (default: the last
        ones pulled), for the staleness count. ``buffers``: this worker's buffer values,
        reported first (``report_buffers``); ``momentum``: that of its next push, reported
        first where it changed (``report_momentum``). ``ask_key``: the request for the next
        data key goes out behind the last push frame, before its reply is read, so the server
        answers it as soon as it has applied the push (``next_key`` reads the answer): one
        wait a key, not two."""
        if pull_into is not None and pull_into.dtype != self.dtype:
            raise ValueError(f"pull_into must be {self.dtype}, the wire dtype")
        self._no_key_out("push")
        t0 = time.perf_counter()
        rows = self._layout(shards, grad_sum.numel())
        self.trained += steps                # the buffers reported below have seen them
        if buffers is not None:
            self.report_buffers(buffers)
        if momentum is not None:
            self.report_momentum(momentum)
        op = OPS["push"] if pull_into is None else OPS["pushpull"]
        sent, skipped = [], []
        for i, size, off in rows:
            if self._skip[i] > 0:            # this shard has the step already (see hello)
                self._skip[i] = max(self._skip[i] - steps, 0)
                skipped.append((i, size, off))
            else:
                sent.append((i, size, off))
        # the key request rides behind the last frame, unless pulls of skipped shards follow
        ask = ask_key and not skipped and bool(sent)
        stale = []
        for n, (i, size, off) in enumerate(sent):
            g = grad_sum[off:off + size]
            self.conn.send(op, g if g.dtype == self.dtype else g.to(self.dtype),
                           worker=self.worker, shard=i,
                           version=(versions or self.versions)[i], count=samples, steps=steps)
            if ask and n == len(sent) - 1:   # a header: it never blocks the server's reply
                self.conn.send(OPS["key"], worker=self.worker)
                self._key_asked = True
            if pull_into is not None:    # large replies: one shard at a time, so that the
                stale.append(self._read_values(i, pull_into[off:off + size]))  # peers never
        if pull_into is None:            # both block writing; small replies: all pushes
            for _ in sent:               # went out, now read them
                stale.append(self._reply(0)[3])
        for i, size, off in skipped:
            stale.insert([r[0] for r in rows].index(i), 0)
            if pull_into is not None:
                self.conn.send(OPS["pull"], worker=self.worker, shard=i,
                               code=DTYPE_CODES[pull_into.dtype])
                self._read_values(i, pull_into[off:off + size])
        self.push_seconds += time.perf_counter() - t0
        return stale

    def close(self) -> None:
        try:
            self.conn.send(OPS["bye"], worker=self.worker)
        except OSError:
            pass
        self.conn.sock.close()
