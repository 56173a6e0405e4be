"""Parameter server of Downpour SGD (DistBelief), run by the driver for the duration of a fit.

The parameters live on the server as one flat vector cut into ``shards`` contiguous blocks
(shard.py); workers are ordinary Spark tasks that talk to it over TCP in the frames of wire.py
(client.py). Each connection's thread reads its nonce and hello; from ``LOOP_FROM`` workers on,
where no push ever waits for another worker's (modes async and sequential without
max_staleness) and one shard's lock serialises them anyway, one event-loop thread then serves
every worker's frames (loop.py). Any malformed frame closes that connection only. A push may
ask for the shard's values after it in the same reply (op "pushpull"): a worker that fetches
right after pushing pays one round trip, not two. A pull with steps=1 asks "if newer than the
version I hold": an unchanged shard replies with its version and no values (a header's
bytes). The server counts the mini-batch steps it applied per worker id; the hello reply says
how many, so that a task Spark retries goes on from there instead of redoing its shard.

The server is made of parts handed to it or made from its mode:
  rule        how a push becomes a step (rule.py: the optimizer, its schedule, the average,
              the clip, the look-ahead, staleness_lr).
  mode        async (Downpour: every push is applied on arrival, one optimizer step per
              push); sequential ("workers as boosters": every push of the sum of k
              mini-batch gradients is its own step in arrival order, fetched right after);
              sync (rounds.py: one averaged step of all workers' pushes of a step).
  max_staleness  the stale-synchronous bound, any mode (bound.py).
  keys        Boosting's data keys and their leases (leases.py; sequential, one shard).
  buffers     the initial values of the model's floating-point buffers, flat (buffers.py):
              a worker reports its buffers with each push (op "buffers", no reply, just
              before the push on the same connection); the server's ``buffers()`` is the
              mean of every worker's latest report, weighted by the mini-batches it trained.
  board       a memory-mapped file of the shards' versions for the workers on this machine
              (board.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections import Counter

import numpy as np
import torch

from .board import VersionBoard
from .bound import StalenessBound
from .buffers import BufferMean
from .leases import KeyLeases
from .payload import as_tensor, is_finite
from .rounds import SyncRounds
from .rule import StepRule
from .serving import Connections
from .shard import Shard
from .wire import DTYPES, OPS, Conn, PSError

__all__ = ["MODES", "ParameterServer"]

MODES = ("async", "sync", "sequential")
# workers from which one event-loop thread serves them (loop.py); below, a thread each: the
# thread of a worker waiting for its reply runs on that worker's idle core, where one loop
# thread takes its CPU from a replica still computing; from 8 on, threads contending for the
# GIL cost more (docs/guides/downpour.md, "How many replicas one server feeds")
LOOP_FROM = 8


class ParameterServer:
    """Serve ``initial`` (a flat tensor) to ``workers`` Spark tasks; see the module doc.
    ``bounds``: the shards as the caller cut them (else ``shards`` even blocks).
    ``loop``: serve the workers from one event-loop thread once their hello is done (None:
    from ``LOOP_FROM`` workers on; only where no push waits and one shard: else threads)."""

    def __init__(self, initial: torch.Tensor, secret: bytes, host: str = "127.0.0.1", *,
                 rule: StepRule | None = None, mode: str = "async", workers: int = 1,
                 shards: int = 1, bounds: list[int] | None = None,
                 max_staleness: int | None = None, timeout_s: float = 300.0,
                 buffers: torch.Tensor | None = None, keys: KeyLeases | None = None,
                 board: str | os.PathLike | None = None, loop: bool | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        self.rule = (rule or StepRule()).for_mode(mode)
        self.bounds = _bounds(initial.numel(), shards, bounds)
        if keys is not None and (mode != "sequential" or len(self.bounds) != 2):
            raise ValueError("data keys need mode='sequential' and one shard (a push is "
                             "applied whole, or dropped whole)")
        self.secret, self.mode, self.workers, self.timeout_s = secret, mode, workers, timeout_s
        self.keys = keys
        self.rounds = SyncRounds(workers, timeout_s) if mode == "sync" else None
        self.bound = StalenessBound(max_staleness, timeout_s)
        self.dtype = initial.dtype
        flat = initial.detach().reshape(-1).cpu()
        self.shards = [self.rule.shard(flat[a:b]) for a, b in itertools.pairwise(self.bounds)]
        self.stats_of_buffers = BufferMean(torch.zeros(0, dtype=self.dtype) if buffers is None
                                           else buffers.to(self.dtype))
        self.max_payload = max(max(b - a for a, b in itertools.pairwise(self.bounds)),
                               self.stats_of_buffers.numel) * 8
        self.epoch_steps = 0            # mini-batch steps of one epoch, from the workers' hellos
        self.start_epoch = 0            # restored from a checkpoint: epochs done before
        self.staleness: Counter = Counter()     # staleness -> pushes
        self.pushes = self.pulls = self.dropped = self.momentum_reports = 0
        self.bytes_in = self.bytes_out = 0
        self.push_seconds = self.pull_seconds = 0.0
        self._stats_lock = threading.Lock()
        self._hello = threading.Condition()
        self._registered: dict[int, tuple[int, int]] = {}      # worker -> (rows, batch)
        # the shards' versions in a mapped file for the workers on this machine (board.py);
        # where the file cannot be made or mapped, the workers ask the server as before
        self.board = None
        if board is not None:
            with contextlib.suppress(OSError, ValueError):
                self.board = VersionBoard(board, len(self.shards))
        self._stop = threading.Event()
        # one thread serves the workers' pushes where none waits for another (loop.py)
        if loop is None:
            loop = workers >= LOOP_FROM
        if mode == "sync" or max_staleness is not None or len(self.shards) > 1:
            loop = False                 # pushes that wait, or shards stepped in parallel
        self.connections = Connections(self, host, loop)
        self.address = self.connections.address

    # -- state ---------------------------------------------------------------------------
    def parameters(self, averaged: bool = True) -> torch.Tensor:
        """A consistent-per-shard copy of the current flat parameters: their average where the
        server keeps one and ``averaged``, else the values themselves (what the workers fetch,
        less the look-ahead where the server keeps one)."""
        out = []
        for s in self.shards:
            with s.lock:
                v = s.avg if averaged and s.avg is not None else s.param
                out.append(v.detach().clone())
        return torch.cat(out)

    def buffers(self) -> torch.Tensor:
        """The model's floating-point buffers: the weighted mean of the workers' latest reports."""
        return self.stats_of_buffers.mean()

    @property
    def versions(self) -> list[int]:
        return [s.version for s in self.shards]

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    @property
    def waits(self) -> int:
        """Pushes the stale-synchronous bound held back."""
        return self.bound.waits

    @property
    def split(self) -> dict[int, int] | None:
        """Balanced sync rounds: worker -> its rows per step (else None)."""
        return None if self.rounds is None else self.rounds.split

    def settle(self, timeout_s: float = 5.0) -> bool:
        """Wait until every shard has applied as many steps as shard 0 had at the call: the
        pushes of one step reach the shards one after another, and the partitions of a
        model-parallel replica push to their shards separately, so when a replica reports an
        epoch another shard may still miss its last push. False if that took ``timeout_s``."""
        def total(s) -> int:
            with s.lock:
                return sum(s.done.values())
        target = total(self.shards[0])
        deadline = time.monotonic() + timeout_s
        while not all(total(s) >= target for s in self.shards):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def state_dict(self) -> dict:
        """Everything a restarted server needs: each shard's values, optimizer state, version
        and steps applied (each shard's under its lock)."""
        kept = []
        for s in self.shards:
            with s.lock:
                kept.append(s.state())
        return {"bounds": list(self.bounds), "values": [k["values"] for k in kept],
                "optimizer": [k["optimizer"] for k in kept],
                "versions": [k["version"] for k in kept], "steps": [k["steps"] for k in kept],
                "averages": [k["average"] for k in kept], "buffers": self.buffers(),
                "norms": [k["norm"] for k in kept]}          # clip's running norm

    def load_state_dict(self, state: dict, start_epoch: int = 0) -> None:
        """Restore ``state_dict()``'s output (before any worker arrives); the workers then
        start at epoch ``start_epoch`` (their hello tells them so). The optimizer's state
        (its buffers) comes from the checkpoint, its settings stay this server's: a fit
        resumed under another staleness rule runs that rule's momentum (and a momentum of 0
        drops the saved buffer), not the one saved."""
        if list(state["bounds"]) != self.bounds:
            raise ValueError(f"the saved server has shards {state['bounds']}, this one "
                             f"{self.bounds}: a different model or partitioning")
        averages = state.get("averages") or [None] * len(self.shards)  # older checkpoints
        norms = state.get("norms") or [(0.0, 0)] * len(self.shards)
        if state.get("buffers") is not None:
            self.stats_of_buffers.load(state["buffers"])
        for s, values, opt, version, steps, saved, norm in zip(
                self.shards, state["values"], state["optimizer"], state["versions"],
                state["steps"], averages, norms):
            with s.lock:
                s.load_state(values, opt, version, steps, saved, norm)
                self._posted(s)
        self.start_epoch = start_epoch

    def take_gradient_mean_abs(self) -> float | None:
        """The mean |gradient| per coordinate of the updates applied since the last call (each
        shard's steps averaged, weighted by its size), then reset: the thesis's Fig. 4.3b
        statistic, one value per epoch. None when nothing was applied."""
        total, seen = 0.0, False
        for s in self.shards:
            with s.lock:
                if s.abs_steps:
                    total += s.abs_sum / s.abs_steps
                    seen = True
                s.abs_sum, s.abs_steps = 0.0, 0
        return total / self.numel if seen else None

    def stats(self) -> dict:
        return {"mode": self.mode, "shards": len(self.shards), "versions": self.versions,
                "serving": "threads" if self.connections.loop is None else "loop",
                "pushes": self.pushes, "pulls": self.pulls, "dropped_stale": self.dropped,
                "max_staleness": self.bound.max_staleness, "held_back_pushes": self.waits,
                "rejected_connections": self.connections.rejected,
                "turned_away_before_hello": self.connections.arrivals.turned_away,
                "staleness_histogram": dict(sorted(self.staleness.items())),
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "push_seconds": self.push_seconds, "pull_seconds": self.pull_seconds,
                "clip": self.rule.clip, "clipped_steps": sum(s.clipped for s in self.shards),
                "look_ahead": self.shards[0].ahead is not None,
                "momentum_reports": self.momentum_reports}

    def close(self) -> None:
        self._stop.set()
        self.connections.stop_listening()
        for s in self.shards:
            with s.lock:
                s.lock.notify_all()
        self.bound.close()
        with self._hello:
            self._hello.notify_all()
        if self.keys is not None:
            self.keys.close()
        self.connections.close()
        if self.board is not None:
            self.board.close()

    # -- serving -------------------------------------------------------------------------
    def _closed(self, conn: Conn) -> None:
        with self._stats_lock:
            self.bytes_in += conn.bytes_received
            self.bytes_out += conn.bytes_sent
        for s in self.shards:             # a worker gone (bye, killed, refused): its momentum
            if s.ahead is not None:       # step to come out of the look-ahead (a retried task
                with s.lock:              # connects anew, its buffer empty)
                    s.ahead.forget(conn)

    def _dispatch(self, conn, op, code, steps, worker, shard, version, count, payload) -> bool:
        if self._stop.is_set():           # closed: a late frame changes nothing, and its
            return False                  # connection closes
        bound = conn.worker
        if bound is not None and worker != bound:
            raise PSError(f"this connection registered as worker {bound}, a frame says {worker}")
        if op in (OPS["bye"], OPS["pull"], OPS["key"]) and len(payload):
            raise PSError(f"a {next(k for k, v in OPS.items() if v == op)} frame carries no "
                          f"payload, got {len(payload)} bytes")
        if op == OPS["bye"]:
            self.bound.leave(worker)
            return False                 # (its momentum step to come goes with it: _closed)
        if op == OPS["hello"]:
            return self._on_hello(conn, worker, payload)
        if bound is None:          # else a frame could speak for any worker (its step count)
            raise PSError(f"a {next((k for k, v in OPS.items() if v == op), op)} frame before "
                          f"the connection's hello: a worker says hello first")
        if op == OPS["buffers"]:                  # a report, no reply (see the module doc)
            self._on_buffers(worker, code, payload, count)
            return True
        if op == OPS["momentum"]:                 # a report, no reply (look-ahead)
            self._on_momentum(conn, code, payload)
            return True
        if op == OPS["key"]:
            if self.keys is None:
                raise PSError("a key request needs a fit with data keys")
            conn.send(OPS["ok"], self.keys.reply(worker))
            return True
        if not 0 <= shard < len(self.shards):
            raise PSError(f"shard {shard} does not exist (0..{len(self.shards) - 1})")
        if op == OPS["pull"]:
            self._on_pull(conn, self.shards[shard], shard, code, steps, version)
            return True
        if op in (OPS["push"], OPS["pushpull"]):
            self._on_push(conn, op, shard, code, steps, worker, version, count, payload)
            return True
        raise PSError(f"unknown op {op}")

    def _on_pull(self, conn: Conn, s: Shard, shard: int, code: int, steps: int,
                 version: int) -> None:
        t0 = time.perf_counter()
        with s.lock:                          # steps=1: "if newer than version"
            v = s.version
            values = None if steps == 1 and version == v else s.fetched(self.epoch_steps)
        with self._stats_lock:
            self.pulls += values is not None
        conn.send(OPS["ok"], None if values is None else
                  values.to(DTYPES[code] if code in (0, 1, 2) else self.dtype),
                  shard=shard, version=v)
        with self._stats_lock:
            self.pull_seconds += time.perf_counter() - t0

    def _on_push(self, conn: Conn, op: int, shard: int, code: int, steps: int, worker: int,
                 version: int, count: int, payload) -> None:
        t0 = time.perf_counter()
        s = self.shards[shard]
        if code == 3:
            raise PSError("gradients must be float32, float64 or bfloat16")
        itemsize = DTYPES[code].itemsize
        if len(payload) != s.param.numel() * itemsize:
            raise PSError(f"push to shard {shard}: {len(payload)} bytes, expected "
                          f"{s.param.numel() * itemsize}")
        grad = as_tensor(payload, code)
        if grad.dtype != self.dtype:
            grad = grad.to(self.dtype)
        if not is_finite(grad):
            raise PSError(f"push to shard {shard} holds NaN or inf; the worker diverged "
                          f"(lower the learning rate)")
        if shard == 0 and self.bound.max_staleness is not None:
            self.bound.wait(worker, self._stop)
        pull = op == OPS["pushpull"]         # the reply carries the shard after the push
        new_version, staleness, values = self._push(s, worker, grad, version, count,
                                                    max(steps, 1), pull, conn)
        with self._stats_lock:               # counted before the reply: a caller that
            self.pushes += 1                  # got its answer sees its push counted
            self.pulls += pull
            self.push_seconds += time.perf_counter() - t0
        if values is not None and values.dtype != DTYPES[code]:
            values = values.to(DTYPES[code])
        conn.send(OPS["ok"], values, shard=shard, version=new_version, count=staleness)

    def _on_buffers(self, worker: int, code: int, payload, trained: int) -> None:
        if code not in (0, 1, 2):
            raise PSError("buffer values must be float32, float64 or bfloat16")
        itemsize = DTYPES[code].itemsize
        n = self.stats_of_buffers.numel
        if n == 0 or len(payload) != n * itemsize:
            raise PSError(f"a buffers report of {len(payload)} bytes, expected {n * itemsize} "
                          f"({n} values of the model's floating-point buffers)")
        values = torch.frombuffer(payload, dtype=torch.uint8).view(DTYPES[code])
        self.stats_of_buffers.report(worker, values, trained)

    def _on_momentum(self, conn: Conn, code: int, payload) -> None:
        """The momentum of the connection's next pushes (look-ahead), on the connection: a
        task's attempt is one connection, its buffer its own."""
        if self.shards[0].ahead is None:
            raise PSError("a momentum report needs a server with look-ahead (staleness "
                          "rule 'dana')")
        if code != 1 or len(payload) != 8:
            raise PSError(f"a momentum report carries one float64 (dtype code 1, 8 bytes), "
                          f"got dtype code {code} and {len(payload)} bytes")
        m = float(np.frombuffer(payload, np.float64)[0])
        if not 0.0 <= m < 1.0:
            raise PSError(f"a worker's momentum must be in [0, 1), got {m}")
        conn.momentum = m
        with self._stats_lock:
            self.momentum_reports += 1

    def _on_hello(self, conn, worker, payload) -> bool:
        if len(payload) not in (16, 40):
            raise PSError("hello carries [rows, batch_size] (and a profile [a_ps, c_ps, cap]) "
                          "as int64")
        info = np.frombuffer(payload, np.int64)
        conn.worker = worker
        self.connections.arrivals.arrived(conn.sock)   # in time (sync: then waits for all)
        rows, batch = int(info[0]), int(info[1])
        self.bound.join(worker)                   # a (re)started worker starts at the slowest
        with self._hello:
            self._registered[worker] = (rows, max(batch, 1))
            if len(info) == 5 and self.rounds is not None:   # t(b) = a + c b in ps, memory cap
                self.rounds.profiles[worker] = (info[2] * 1e-12, info[3] * 1e-12, int(info[4]))
            self._hello.notify_all()
            per_worker = [-(-r // b) for r, b in self._registered.values()]
            if self.keys is None:                 # with keys: the owner sets it
                self.epoch_steps = max(per_worker) if self.mode == "sync" else sum(per_worker)
            mine = batch
            if self.rounds is not None:      # everyone runs the steps of the largest shard
                steps, share = self.rounds.hello(worker, self._registered, self._hello,
                                                 self._stop)
                self.epoch_steps = steps
                mine = batch if share is None else share
            else:
                steps = -(-rows // max(batch, 1))
            done = [s.done[worker] + self.start_epoch * steps for s in self.shards]
        conn.send(OPS["ok"], np.array(self.bounds + done + [steps, mine], np.int64),
                  count=self.numel, version=sum(self.versions))
        return True

    def _posted(self, s: Shard) -> None:
        """Shard ``s``'s version onto the board, if any (under its lock, after its step)."""
        board = self.board
        if board is not None:
            board.write(self.shards.index(s), s.version)

    def _push(self, s: Shard, worker: int, grad: torch.Tensor, base: int, samples: int,
              steps: int, pull: bool = False, conn: Conn | None = None):
        """Apply (or collect) one push (of ``conn``, if any: the look-ahead's key); returns
        (version, staleness, and with ``pull`` the shard's values after it, copied under the
        lock so that they belong to that version)."""
        with s.lock:
            staleness = s.version - base
            if self.rounds is not None:
                if staleness > 0:                     # computed on an older round: dropped
                    self.dropped += 1
                else:
                    self.staleness[0] += 1
                    self.rounds.collect(s, worker, grad, samples, steps, self.epoch_steps,
                                        self._stop, self._posted)
                    staleness = 0
                return s.version, staleness, s.fetched(self.epoch_steps) if pull else None
            epoch = None
            if self.keys is not None:            # a push of a key this worker must hold
                epoch = self.keys.take(worker)
                if epoch is None:
                    self.dropped += 1
                    return s.version, staleness, s.fetched(self.epoch_steps) if pull else None
            self.staleness[staleness] += 1
            # the sum of per-sample gradients of `steps` mini-batches -> `steps` x their mean
            s.apply(grad, self.rule.scale(steps, samples, staleness), steps, self.epoch_steps,
                    summed=steps)
            if s.ahead is not None and conn is not None:   # its momentum step to come:
                # the momentum times the step just taken (as scaled and clipped)
                s.ahead.record(conn, s.param.grad, conn.momentum)
            self._posted(s)
            s.done[worker] += steps
            if epoch is not None and self.keys.ended(epoch):   # the epoch's last key
                self.keys.keep(epoch + 1, self.state_dict())
            return s.version, staleness, s.fetched(self.epoch_steps) if pull else None


def _bounds(n: int, shards: int, bounds: list[int] | None) -> list[int]:
    """The shards' bounds in a vector of ``n``: ``bounds`` as the caller cut them, or
    ``shards`` even blocks."""
    if bounds is not None:
        if bounds[0] != 0 or bounds[-1] != n or any(
                a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"bounds must rise strictly from 0 to {n}, got {bounds}")
        return list(bounds)
    if not 1 <= shards <= n:
        raise ValueError(f"shards must be in 1..{n} (the parameter count), got {shards}")
    return [n * i // shards for i in range(shards + 1)]
