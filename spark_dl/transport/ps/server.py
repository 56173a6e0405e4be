"""Parameter server of Downpour SGD (DistBelief), run by the driver for the duration of a fit.

The parameters live on the server as one flat vector cut into ``shards`` contiguous blocks
(shard.py); workers are ordinary Spark tasks that talk to it over TCP in the frames of wire.py
(client.py). Each connection's thread reads its nonce and hello; from ``LOOP_FROM`` workers on,
where no push ever waits for another worker's (modes async and sequential without
max_staleness) and one shard's lock serialises them anyway, one event-loop thread then serves
every worker's frames (loop.py: a thread each made 8.6 context switches a push at 16 workers).
Any malformed frame closes that connection only. A push may ask for the shard's values after it
in the same reply (op "pushpull"): a worker that fetches right after pushing pays one round
trip, not two. A pull with steps=1 asks "if newer than the version I hold": an unchanged shard
replies with its version and no values (a header's bytes). The server counts the mini-batch
steps it applied per worker id; the hello reply says how many, so that a task Spark retries
goes on from there instead of redoing its shard.

The server-side learning rate follows ``schedule`` (spark_dl.optim.schedule: its warmup and
per-epoch decay) over the fractional epochs applied: an epoch is the mini-batch steps of all
workers' shards (sync: of the largest), counted as the pushes carry them. An asynchronous push
of k mini-batches steps f(k) times their mean gradient (``push_scaling``: linear, sqrt, none).

Modes:
  async       Downpour: every push is applied on arrival (one optimizer step per push);
              with staleness_lr, a push computed tau >= 2 versions ago takes a step of
              lr / tau (staleness-aware async SGD, Zhang et al., IJCAI 2016).
  sync        the server waits for all workers' pushes of a step, takes their sample-weighted
              mean, applies it once; pushes computed on older versions are dropped.
  (any mode) max_staleness=S: stale-synchronous bound, a worker more than S pushes ahead of
              the slowest registered worker waits for it.
  sequential  "workers as boosters": every worker pushes the sum of k mini-batch gradients,
              each push is its own optimizer step in arrival order, and the worker fetches the
              result before going on.

Data keys (``keys``, a spark_dl.strategies.boosting.keys.KeyScheduler; sequential mode, one
shard): the workers ask the server for their next key (op "key", reply int64 [status, key,
epoch]: status 0 a key, 1 wait that many milliseconds, 2 finished) and push once per key; a
push is applied only when its worker still holds the key's lease (else it is dropped: the key
went to another worker), and when it completes an epoch the server keeps its state of that
moment (``epoch_states``) for the driver to validate and checkpoint.

Buffers (``buffers``: the initial values of the model's floating-point buffers, flat, e.g.
BatchNorm's running statistics; buffers.py): a worker reports its buffers' values with each
push (op "buffers", no reply, sent just before the push on the same connection); the
server's ``buffers()`` is the mean of every worker's latest report (weighted by the
mini-batches the worker trained, buffers.py), the values the driver
validates, checkpoints and returns with the parameters.

One class, read best whole: its connections, its modes and the state it checkpoints share
the shards' locks and the workers' registry, which a split would pass around.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
import socket
import threading
import time
from collections import Counter

import numpy as np
import torch

from ..channel import Arrivals, accept_loop, stop_listening
from .board import VersionBoard
from .buffers import BufferMean
from .loop import EventLoop, fault
from .shard import SERVER_OPTIMIZERS, Shard
from .wire import DTYPES, OPS, Conn, Growing, PSError

__all__ = ["MODES", "ParameterServer"]

MODES = ("async", "sync", "sequential")
# workers from which one event-loop thread serves them (loop.py); below, a thread each: the
# thread of a worker waiting for its reply runs on that worker's idle core, where one loop
# thread takes its CPU from a replica still computing (2 replicas on 2 cores: 7-10% fewer
# samples a second with the loop); from 8 on, threads contending for the GIL cost more
LOOP_FROM = 8


class ParameterServer:
    """Serve ``initial`` (a flat tensor) to ``workers`` Spark tasks; see the module doc.
    ``loop``: serve the workers from one event-loop thread once their hello is done (None:
    from ``LOOP_FROM`` workers on; only where no push waits and one shard: else threads)."""

    def __init__(self, initial: torch.Tensor, secret: bytes, host: str = "127.0.0.1",
                 shards: int = 1, optimizer: str = "sgd", lr: float = 0.01,
                 momentum: float = 0.9, mode: str = "async", workers: int = 1,
                 max_staleness: int | None = None, timeout_s: float = 300.0,
                 lr_decay: float = 1.0, bounds: list[int] | None = None,
                 staleness_lr: bool = False, average: float = 0.0, keys=None,
                 schedule=None, push_scaling: str = "linear",
                 buffers: torch.Tensor | None = None, clip: float | None = None,
                 loop: bool | None = None, board: str | os.PathLike | None = None,
                 ahead: bool = False):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if optimizer not in SERVER_OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {optimizer!r}; choose one of "
                             f"{', '.join(SERVER_OPTIMIZERS)}")
        n = initial.numel()
        if bounds is not None:                    # shards as the caller cut them
            if bounds[0] != 0 or bounds[-1] != n or any(
                    a >= b for a, b in itertools.pairwise(bounds)):
                raise ValueError(f"bounds must rise strictly from 0 to {n}, got {bounds}")
            shards = len(bounds) - 1
        if not 1 <= shards <= n:
            raise ValueError(f"shards must be in 1..{n} (the parameter count), got {shards}")
        self.secret, self.mode, self.workers = secret, mode, workers
        self.timeout_s, self.max_staleness = timeout_s, max_staleness
        self.staleness_lr = staleness_lr
        self._clocks: dict[int, int] = {}         # worker -> pushes so far (bounded staleness)
        self._clock_cv = threading.Condition()
        self.waits = 0                            # pushes held back by the staleness bound
        self.dtype = initial.dtype
        flat = initial.detach().reshape(-1).cpu()
        self.bounds = list(bounds) if bounds is not None else \
            [n * i // shards for i in range(shards + 1)]
        self.epoch_steps = 0            # mini-batch steps of one epoch, from the workers' hellos
        if not average >= 0:
            raise ValueError(f"average must be >= 0 (a fraction of an epoch), got {average}")
        self.push_scaling = push_scaling          # a push of k mini-batches steps f(k) x mean
        if clip is not None and not clip > 0:
            raise ValueError(f"clip must be > 0 (a multiple of the running gradient norm), "
                             f"got {clip}")
        self.clip = clip if mode != "sync" else None    # a sync round averages: no spikes
        self.momentum_reports = 0                 # look-ahead: the workers' reports
        if ahead and mode == "sync":
            raise ValueError("ahead (the workers' look-ahead, staleness rule 'dana') needs "
                             "pushes stepped one by one: mode='async' or 'sequential', got "
                             "mode='sync'")
        if ahead and not (optimizer == "sgd" or (optimizer == "momentum" and momentum == 0)):
            raise ValueError(f"ahead (the workers' look-ahead) needs a server stepping plain "
                             f"SGD (the momentum is the workers'), got optimizer={optimizer!r} "
                             f"with momentum {momentum}")
        self.shards = [Shard(flat[a:b], optimizer, lr, momentum, lr_decay, average, schedule,
                             self.clip, ahead)
                       for a, b in zip(self.bounds[:-1], self.bounds[1:])]
        self.stats_of_buffers = BufferMean(torch.zeros(0, dtype=self.dtype) if buffers is None
                                           else buffers.to(self.dtype))
        self.max_payload = max(max(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])),
                               self.stats_of_buffers.numel) * 8
        self.staleness: Counter = Counter()     # staleness -> pushes
        self.pushes = self.pulls = self.dropped = self.rejected = 0
        self.bytes_in = self.bytes_out = 0
        self.push_seconds = self.pull_seconds = 0.0
        self._stats_lock = threading.Lock()
        self._hello = threading.Condition()
        self._registered: dict[int, tuple[int, int]] = {}      # worker -> (rows, batch)
        self._profiles: dict[int, tuple[float, float, int]] = {}  # worker -> (a, c, cap)
        self.split: dict[int, int] | None = None  # sync + balance: worker -> rows per step
        self.start_epoch = 0                # restored from a checkpoint: epochs done before
        if keys is not None and (mode != "sequential" or len(self.shards) != 1):
            raise ValueError("data keys need mode='sequential' and one shard (a push is "
                             "applied whole, or dropped whole)")
        self.keys = keys
        # the shards' versions in a mapped file for the workers on this machine (board.py);
        # where the file cannot be made or mapped, the workers ask the server as before
        self.board = None
        if board is not None:
            with contextlib.suppress(OSError, ValueError):
                self.board = VersionBoard(board, len(self.shards))
        self.epoch_states: dict[int, dict] = {}   # keys: epoch -> state_dict() at its end
        self._epochs_cv = threading.Condition()
        self._stop = threading.Event()
        self._handlers: set[socket.socket] = set()    # sockets a thread of _handle serves
        self.arrivals = Arrivals()        # connections whose hello has not come yet
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.address = (host, self._sock.getsockname()[1])
        # one thread serves the workers' pushes where none waits for another (loop.py)
        if loop is None:
            loop = workers >= LOOP_FROM
        if loop and (mode == "sync" or max_staleness is not None or len(self.shards) > 1):
            loop = False                 # pushes that wait, or shards stepped in parallel
        self._loop = EventLoop(self._dispatch, self.max_payload, self._refused,
                               self._closed, on_start=quiet_numpy) if loop else None
        self._thread = threading.Thread(target=self._serve, name="spark_dl-ps", daemon=True)
        self._thread.start()

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
        out = {"bounds": list(self.bounds), "values": [], "optimizer": [], "versions": [],
               "steps": [], "averages": [], "buffers": self.buffers(), "norms": []}
        for s in self.shards:
            with s.lock:
                out["values"].append(s.param.detach().clone())
                out["averages"].append(None if s.avg is None else s.avg.clone())
                out["optimizer"].append(copy.deepcopy(s.opt.state_dict()))
                out["versions"].append(s.version)
                out["steps"].append(s.steps)
                out["norms"].append((s.norm_mean, s.norm_steps))     # clip's running norm
        return out

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
                s.norm_mean, s.norm_steps = float(norm[0]), int(norm[1])
                s.param.data.copy_(values)
                s.load_optimizer(opt)
                s.version, s.steps = int(version), int(steps)
                if s.averaged is not None:     # none saved: the average starts at x
                    s.load_average(saved)
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
                "serving": "threads" if self._loop is None else "loop",
                "pushes": self.pushes, "pulls": self.pulls, "dropped_stale": self.dropped,
                "max_staleness": self.max_staleness, "held_back_pushes": self.waits,
                "rejected_connections": self.rejected,
                "turned_away_before_hello": self.arrivals.turned_away,
                "staleness_histogram": dict(sorted(self.staleness.items())),
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "push_seconds": self.push_seconds, "pull_seconds": self.pull_seconds,
                "clip": self.clip, "clipped_steps": sum(s.clipped for s in self.shards),
                "look_ahead": self.shards[0].ahead is not None,
                "momentum_reports": self.momentum_reports}

    def close(self) -> None:
        self._stop.set()
        stop_listening(self._sock)
        for s in self.shards:
            with s.lock:
                s.lock.notify_all()
        with self._clock_cv:
            self._clock_cv.notify_all()
        with self._hello:
            self._hello.notify_all()
        with self._epochs_cv:
            self._epochs_cv.notify_all()
        with self._stats_lock:            # the connections served by threads (hellos too):
            handled = list(self._handlers)   # a thread blocked in recv returns at once
        for sock in handled:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2)
        if self._loop is not None:
            self._loop.close()
        if self.board is not None:
            self.board.close()

    # -- serving -------------------------------------------------------------------------
    def _serve(self):
        accept_loop(self._sock, self._stop, self._handle, tick=self.arrivals.reap)

    def _handle(self, sock: socket.socket):
        """A connection's thread: the nonce, the hello, and every frame after it unless the
        event loop takes the connection over once the hello is done (loop.py)."""
        quiet_numpy()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(16)
        conn = Conn(sock, self.secret, nonce)
        buf = Growing()
        adopted = refused = False
        if not self.arrivals.admit(sock):   # too many peers mid-handshake: not served
            sock.close()
            return
        with self._stats_lock:
            self._handlers.add(sock)
        try:
            sock.settimeout(self.timeout_s)
            sock.sendall(nonce)
            while not self._stop.is_set():
                frame = conn.recv(self.max_payload, buf)
                if not self._dispatch(conn, *frame):
                    break
                if self._loop is not None and conn.worker is not None:
                    adopted = True               # the loop serves (or closes) it from now
                    self._loop.adopt(conn)
                    return
        except (PSError, ValueError, KeyError, IndexError) as e:
            self._refused(e)
            conn.send_error(e)
            refused = True
        except OSError:
            pass                                         # peer went away (e.g. a killed task)
        except Exception as e:           # a fault of the server's: the worker is told, the
            conn.send_error(fault(e))    # traceback goes to the driver's log (the thread's)
            refused = True
            raise
        finally:            # whatever ended the thread (a fault of ours too): the worker's
            with self._stats_lock:          # connection closes, it does not wait for a reply
                self._handlers.discard(sock)
            self.arrivals.arrived(sock)
            if not adopted:
                self._closed(conn)
                if refused:
                    conn.close_after_error()
                else:
                    sock.close()

    def _refused(self, error: Exception) -> None:
        with self._stats_lock:
            self.rejected += 1

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
            with self._clock_cv:
                self._clocks.pop(worker, None)    # a finished worker holds nobody back
                self._clock_cv.notify_all()
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
            got = self.keys.next(worker)
            reply = [2, 0, 0] if got.get("finished") else \
                [1, max(1, round(got["wait"] * 1000)), 0] if "wait" in got else \
                [0, got["key"], got["epoch"]]
            conn.send(OPS["ok"], np.array(reply, np.int64))
            return True
        if not 0 <= shard < len(self.shards):
            raise PSError(f"shard {shard} does not exist (0..{len(self.shards) - 1})")
        s = self.shards[shard]
        if op == OPS["pull"]:
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
            return True
        if op in (OPS["push"], OPS["pushpull"]):
            t0 = time.perf_counter()
            if code == 3:
                raise PSError("gradients must be float32, float64 or bfloat16")
            itemsize = DTYPES[code].itemsize
            if len(payload) != s.param.numel() * itemsize:
                raise PSError(f"push to shard {shard}: {len(payload)} bytes, expected "
                              f"{s.param.numel() * itemsize}")
            grad = _as_tensor(payload, code)
            if grad.dtype != self.dtype:
                grad = grad.to(self.dtype)
            if not _finite(grad):
                raise PSError(f"push to shard {shard} holds NaN or inf; the worker diverged "
                              f"(lower the learning rate)")
            if shard == 0 and self.max_staleness is not None:
                self._wait_for_slowest(worker)
            pull = op == OPS["pushpull"]         # the reply carries the shard after the push
            new_version, staleness, values = self._push(s, worker, grad, version, count,
                                                        max(steps, 1), pull, conn)
            with self._stats_lock:               # counted before the reply: a caller that
                self.pushes += 1                  # got its answer sees its push counted
                self.pulls += pull
                self.push_seconds += time.perf_counter() - t0
            if values is not None and values.dtype != DTYPES[code]:
                values = values.to(DTYPES[code])
            conn.send(OPS["ok"], values,
                      shard=shard, version=new_version, count=staleness)
            return True
        raise PSError(f"unknown op {op}")

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
        self.arrivals.arrived(conn.sock)          # in time (sync mode then waits for all)
        rows, batch = int(info[0]), int(info[1])
        with self._clock_cv:                      # a (re)started worker starts at the slowest
            others = [c for w, c in self._clocks.items() if w != worker]
            self._clocks[worker] = min(others) if others else 0
        with self._hello:
            self._registered[worker] = (rows, max(batch, 1))
            if len(info) == 5:                    # t(b) = a + c b in picoseconds, memory cap
                self._profiles[worker] = (info[2] * 1e-12, info[3] * 1e-12, int(info[4]))
            self._hello.notify_all()
            per_worker = [-(-r // b) for r, b in self._registered.values()]
            if self.keys is None:                 # with keys: the owner sets it
                self.epoch_steps = max(per_worker) if self.mode == "sync" else sum(per_worker)
            mine = batch
            if self.mode == "sync":          # everyone runs the steps of the largest shard
                deadline = time.monotonic() + self.timeout_s
                while len(self._registered) < self.workers and not self._stop.is_set():
                    if not self._hello.wait(timeout=max(0.0, deadline - time.monotonic())):
                        raise PSError(f"sync mode: only {len(self._registered)} of "
                                      f"{self.workers} workers arrived")
                steps = max(-(-r // b) for r, b in self._registered.values())
                if self._profiles:           # balanced rounds: the global batch split
                    steps, mine = self._balanced(worker)
                    self.epoch_steps = steps
            else:
                steps = -(-rows // max(batch, 1))
            done = [s.done[worker] + self.start_epoch * steps for s in self.shards]
        conn.send(OPS["ok"], np.array(self.bounds + done + [steps, mine], np.int64),
                  count=self.numel, version=sum(self.versions))
        return True

    def next_epoch_state(self, epoch: int, timeout_s: float) -> dict | None:
        """Data keys: the server's state_dict() when epoch ``epoch`` (1-based) ended, waiting
        up to ``timeout_s`` for it (None if it did not end, or the server closed)."""
        deadline = time.monotonic() + timeout_s
        with self._epochs_cv:
            while epoch not in self.epoch_states and not self._stop.is_set():
                if not self._epochs_cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    break
            return self.epoch_states.pop(epoch, None)

    def _balanced(self, worker: int) -> tuple[int, int]:
        """(steps per epoch, ``worker``'s rows per step) of balanced sync rounds: the workers'
        global batch split so that their steps take as long (spark_dl.balance), once
        for the fit (a retried worker gets its share again); an epoch is ceil(rows / global
        batch) rounds. Called with every worker registered, under the hello lock."""
        from ...balance import equal_time_split
        ids = sorted(self._registered)
        total = sum(self._registered[w][1] for w in ids)
        if self.split is None:
            if set(self._profiles) != set(ids):
                raise PSError(f"balanced sync rounds need every worker's profile; workers "
                              f"{sorted(set(ids) - set(self._profiles))} sent none")
            rows = [w for w in ids if self._registered[w][0] > 0]  # empty shards: no share
            fns = [lambda b, a=self._profiles[w][0], c=self._profiles[w][1]: a + c * b
                   for w in rows]
            shares = equal_time_split(total, fns, [self._profiles[w][2] for w in rows])
            self.split = dict.fromkeys(ids, 0) | dict(zip(rows, shares))
        rows = sum(r for r, _ in self._registered.values())
        return max(1, -(-rows // total)), self.split[worker]

    def _wait_for_slowest(self, worker: int) -> None:
        """Stale-synchronous bound: a worker more than max_staleness pushes ahead of the
        slowest registered worker waits for it."""
        with self._clock_cv:
            clock = self._clocks.get(worker, 0) + 1
            self._clocks[worker] = clock
            self._clock_cv.notify_all()
            deadline = time.monotonic() + self.timeout_s
            held = False
            while not self._stop.is_set() and \
                    clock - min(self._clocks.values()) > self.max_staleness:
                held = True
                if not self._clock_cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise PSError(f"worker {worker} waited {self.timeout_s} s for the slowest "
                                  f"worker (max_staleness={self.max_staleness})")
            self.waits += held

    @property
    def numel(self) -> int:
        return self.bounds[-1]

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
            if self.keys is not None:            # a push of a key this worker must hold
                epoch = self.keys.epoch
                if self.keys.applied(worker) is None:
                    self.dropped += 1
                    return s.version, staleness, s.fetched(self.epoch_steps) if pull else None
            if self.mode != "sync":
                self.staleness[staleness] += 1
                # the sum of per-sample gradients of `steps` mini-batches -> `steps` x their mean
                scale = _push_factor(self.push_scaling, steps) / max(samples, 1)
                if self.staleness_lr and staleness > 1:
                    scale /= staleness
                s.apply(grad, scale, steps, self.epoch_steps, summed=steps)
                if s.ahead is not None and conn is not None:   # its momentum step to come:
                    # the momentum times the step just taken (as scaled and clipped)
                    s.ahead.record(conn, s.param.grad, conn.momentum)
                self._posted(s)
                s.done[worker] += steps
                if self.keys is not None and self.keys.epoch > epoch:   # the epoch's last key
                    state = self.state_dict()
                    with self._epochs_cv:
                        self.epoch_states[epoch + 1] = state
                        self._epochs_cv.notify_all()
                return s.version, staleness, s.fetched(self.epoch_steps) if pull else None
            if staleness > 0:                     # computed on an older round: dropped
                self.dropped += 1
                return s.version, staleness, s.fetched(self.epoch_steps) if pull else None
            self.staleness[0] += 1
            s.done[worker] += steps               # in the round: done, whoever completes it
            if s.round_sum is None:
                s.round_sum = torch.zeros_like(s.param)
            s.round_sum += grad
            s.round_count += samples
            s.round_workers.add(worker)
            target = s.version + 1
            if len(s.round_workers) >= self.workers:
                s.apply(s.round_sum, 1.0 / max(s.round_count, 1.0), steps, self.epoch_steps)
                self._posted(s)
                s.round_sum.zero_()
                s.round_count = 0.0
                s.round_workers.clear()
                s.lock.notify_all()
            else:
                deadline = time.monotonic() + self.timeout_s
                while s.version < target and not self._stop.is_set():
                    if not s.lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                        raise PSError(f"sync mode: round {target} of shard incomplete after "
                                      f"{self.timeout_s} s (a worker is missing)")
            return s.version, 0, s.fetched(self.epoch_steps) if pull else None


def _as_tensor(payload, code: int) -> torch.Tensor:
    """The payload's values, no copy (numpy's view where it has the dtype: a torch op's
    dispatch costs more than a small model's values)."""
    if code == 2:                                   # bfloat16: numpy has none
        return torch.frombuffer(payload, dtype=torch.uint8).view(torch.bfloat16)
    return torch.from_numpy(np.frombuffer(payload, np.float32 if code == 0 else np.float64))


def _finite(grad: torch.Tensor) -> bool:
    """No NaN nor inf in ``grad``: its sum is finite (one pass), or else every value is (a
    finite sum can overflow). Small pushes sum in numpy (a few µs, where torch's three ops
    cost ~40); large ones in torch, whose sum uses every thread."""
    if grad.numel() < 1 << 20 and grad.dtype in (torch.float32, torch.float64):
        a = grad.numpy()
        if np.isfinite(a.sum()):          # the serving threads quiet numpy's overflow warning
            return True                   # (quiet_numpy): a numpy.errstate here costs a
        with np.errstate(over="ignore", invalid="ignore"):    # push 15 µs of the server's CPU
            return bool(np.isfinite(a).all())
    return bool(torch.isfinite(grad.sum()) or torch.isfinite(grad).all())


def quiet_numpy() -> None:
    """In the calling thread only (numpy keeps its error state per thread, or per context
    from numpy 2): an overflowing sum of a push is a bad push, refused with its own error, not
    a RuntimeWarning in the driver's log."""
    np.seterr(over="ignore", invalid="ignore")


def _push_factor(rule: str, steps: int) -> float:
    """f(k) of an asynchronous push that sums k mini-batches' gradients: the step it takes is
    f(k) times their mean (linear: k, as k sequential steps would; sqrt: sqrt(k); none: 1)."""
    return float(steps) if rule == "linear" else math.sqrt(steps) if rule == "sqrt" else 1.0
