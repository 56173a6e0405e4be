"""Parameter server of Downpour SGD (DistBelief), run by the driver for the duration of a fit.

The parameters live on the server as one flat vector cut into ``shards`` contiguous blocks;
each block has its own lock, version counter and server-side optimizer (a torch optimizer on
that block, so the arithmetic is exactly torch's). Workers are ordinary Spark tasks that talk
to it over TCP with a compact binary protocol:

    frame  = header (72 bytes) + payload
    header = magic "SDPS" | op | dtype | steps | worker | shard | version | count | length | mac
    mac    = HMAC-SHA256(secret, nonce of the connection | sequence number | header fields)

The secret is made per fit on the driver and reaches the tasks in the task closure; the nonce
is the server's greeting to each connection, the sequence number counts the connection's
frames, so a frame cannot be forged without the secret nor replayed. Payloads are raw arrays
(float32, float64 or bfloat16 parameters and gradients, int64 for control data), never
pickled, and their length must equal what the op and shard imply, so a frame claiming 10 GB
is refused before a byte of it is read. Any malformed frame closes that connection only.
A push may ask for the shard's values after it in the same reply (op "pushpull"): a worker that
fetches right after pushing pays one round trip, not two. The server counts the mini-batch steps
it applied per worker id; the hello reply says how many, so that a task Spark retries goes on
from there instead of redoing its shard.

Averaged parameters (``average`` = a > 0): besides its parameters x each shard keeps their
exponential moving average over about a x (an epoch's pushes), x̄ <- x̄ + (x - x̄) / (a E)
after every step (x̄ = x while a E <= 1). Workers always fetch x; ``parameters()`` (the model
the driver validates and returns) is x̄: it damps the last iterates' noise, which asynchronous
pushes add to (docs/benchmarks.md, "Downpour SGD").

The server-side learning rate decays per epoch (lr_decay): an epoch is the mini-batch steps of
all workers' shards (sync: of the largest), counted as the pushes carry them.

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

Data keys (``keys``, a spark_dl.strategies.boosting.keys.KeyScheduler; sequential mode, one shard): the
workers ask the server for their next key (op "key", reply int64 [status, key, epoch]: status
0 a key, 1 wait that many milliseconds, 2 finished) and push once per key; a push is applied
only when its worker still holds the key's lease (else it is dropped: the key went to another
worker), and when it completes an epoch the server keeps its state of that moment
(``epoch_states``) for the driver to validate and checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import itertools
import os
import socket
import struct
import threading
import time
from collections import Counter

import numpy as np
import torch

__all__ = ["MODES", "OPS", "SERVER_OPTIMIZERS", "PSClient", "PSError", "ParameterServer"]

MAGIC = b"SDPS"
MODES = ("async", "sync", "sequential")
SERVER_OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam", "rmsprop")
OPS = {"hello": 1, "pull": 2, "push": 3, "bye": 4, "pushpull": 5, "key": 6, "ok": 10,
       "error": 11}
DTYPES = {0: torch.float32, 1: torch.float64, 2: torch.bfloat16, 3: torch.int64}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
_HEAD = struct.Struct("!4sBBHIIqqQ")          # without the MAC
HEADER_BYTES = _HEAD.size + 32


class PSError(RuntimeError):
    """The parameter server refused a request or the connection broke."""


def _mac(secret: bytes, nonce: bytes, seq: int, head: bytes) -> bytes:
    return hmac.new(secret, nonce + seq.to_bytes(8, "big") + head, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:n], n - got)
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return buf[:n]


class _Conn:
    """One side of an authenticated connection: frames with MACs and sequence numbers."""

    def __init__(self, sock: socket.socket, secret: bytes, nonce: bytes):
        self.sock, self.secret, self.nonce = sock, secret, nonce
        self.send_seq = self.recv_seq = 0
        self.bytes_sent = self.bytes_received = 0
        self.worker: int | None = None           # bound by the hello (server side)

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
        # one gather-write for header and payload: no small segment left for Nagle to hold
        sent = self.sock.sendmsg([head, view] if len(view) else [head])
        if sent < len(head):                          # a partial write: finish it
            self.sock.sendall(head[sent:])
            sent = len(head)
        if sent - len(head) < len(view):
            self.sock.sendall(view[sent - len(head):])
        self.send_seq += 1
        self.bytes_sent += HEADER_BYTES + len(view)

    def recv(self, max_payload: int, into: memoryview | None = None):
        """(op, dtype, steps, worker, shard, version, count, payload memoryview)."""
        raw = bytes(_recv_exact(self.sock, HEADER_BYTES))
        head, mac = raw[:_HEAD.size], raw[_HEAD.size:]
        magic, op, code, steps, worker, shard, version, count, length = _HEAD.unpack(head)
        if magic != MAGIC:
            raise PSError("bad magic: not a spark_dl parameter-server frame")
        if op == OPS["error"]:
            max_payload, into = max(max_payload, 4096), None
        if not hmac.compare_digest(mac, _mac(self.secret, self.nonce, self.recv_seq, head)):
            raise PSError("bad MAC: the peer does not know this fit's secret (or replayed a "
                          "frame)")
        if code not in DTYPES:
            raise PSError(f"unknown dtype code {code}")
        if length > max_payload:
            raise PSError(f"frame announces {length} payload bytes, more than the {max_payload} "
                          f"this request may carry")
        if isinstance(into, _Growing):
            into = into.get(length)
        payload = _recv_exact(self.sock, length, into) if length else memoryview(b"")
        self.recv_seq += 1
        self.bytes_received += HEADER_BYTES + length
        return op, code, steps, worker, shard, version, count, payload


class _Growing:
    """A receive buffer that grows to the largest frame seen (never beyond max_payload)."""

    def __init__(self):
        self.buf = memoryview(bytearray(0))

    def get(self, n: int) -> memoryview:
        if len(self.buf) < n:
            self.buf = memoryview(bytearray(n))
        return self.buf


class _Shard:
    def __init__(self, values: torch.Tensor, optimizer: str, lr: float, momentum: float,
                 lr_decay: float = 1.0, average: float = 0.0):
        self.param = torch.nn.Parameter(values.clone(), requires_grad=False)
        self.average = average
        self.avg = values.clone() if average > 0 else None     # x̄, see the module doc
        self.param.grad = torch.zeros_like(self.param)
        opts = {"sgd": lambda: torch.optim.SGD([self.param], lr=lr),
                "momentum": lambda: torch.optim.SGD([self.param], lr=lr, momentum=momentum),
                "adagrad": lambda: torch.optim.Adagrad([self.param], lr=lr),
                "adam": lambda: torch.optim.Adam([self.param], lr=lr),
                "rmsprop": lambda: torch.optim.RMSprop([self.param], lr=lr)}
        self.opt = opts[optimizer]()
        self.lr, self.lr_decay = lr, lr_decay
        self.steps = 0                  # mini-batch steps applied (a push of k counts k)
        self.done: Counter = Counter()  # worker -> its mini-batch steps applied (sync: taken)
        self.lock = threading.Condition()
        self.version = 0
        # sync mode: the round being collected
        self.round_sum: torch.Tensor | None = None       # allocated by the first sync push
        self.round_count = 0.0
        self.round_workers: set[int] = set()
        # sum over applied steps of the mean gradient's |g| summed over the shard (Fig. 4.3b)
        self.abs_sum, self.abs_steps = 0.0, 0

    def apply(self, grad: torch.Tensor, scale: float = 1.0, steps: int = 1,
              epoch_steps: int = 0, summed: int = 1) -> None:
        """One optimizer step on ``grad * scale``, the sum of ``summed`` mini-batch mean
        gradients, counted as ``steps`` mini-batch steps."""
        if self.lr_decay != 1.0 and epoch_steps > 0:    # lr * decay^(epochs applied so far)
            self.opt.param_groups[0]["lr"] = self.lr * self.lr_decay ** (self.steps //
                                                                         epoch_steps)
        self.param.grad.copy_(grad)
        if scale != 1.0:
            self.param.grad.mul_(scale)
        self.abs_sum += float(self.param.grad.abs().sum()) / summed
        self.abs_steps += 1
        self.opt.step()
        if self.avg is not None:
            span = self.average * epoch_steps
            if span > 1:
                self.avg.lerp_(self.param.detach(), 1.0 / span)
            else:
                self.avg.copy_(self.param.detach())
        self.steps += steps
        self.version += 1


class ParameterServer:
    """Serve ``initial`` (a flat tensor) to ``workers`` Spark tasks; see the module doc."""

    def __init__(self, initial: torch.Tensor, secret: bytes, host: str = "127.0.0.1",
                 shards: int = 1, optimizer: str = "sgd", lr: float = 0.01,
                 momentum: float = 0.9, mode: str = "async", workers: int = 1,
                 max_staleness: int | None = None, timeout_s: float = 300.0,
                 lr_decay: float = 1.0, bounds: list[int] | None = None,
                 staleness_lr: bool = False, average: float = 0.0, keys=None):
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
        self.shards = [_Shard(flat[a:b], optimizer, lr, momentum, lr_decay, average)
                       for a, b in zip(self.bounds[:-1], self.bounds[1:])]
        self.max_payload = max(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])) * 8
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
        self.epoch_states: dict[int, dict] = {}   # keys: epoch -> state_dict() at its end
        self._epochs_cv = threading.Condition()
        self._stop = threading.Event()
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.address = (host, self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name="spark_dl-ps", daemon=True)
        self._thread.start()

    # -- state ---------------------------------------------------------------------------
    def parameters(self, averaged: bool = True) -> torch.Tensor:
        """A consistent-per-shard copy of the current flat parameters: their average where the
        server keeps one and ``averaged``, else the values the workers fetch."""
        out = []
        for s in self.shards:
            with s.lock:
                v = s.avg if averaged and s.avg is not None else s.param
                out.append(v.detach().clone())
        return torch.cat(out)

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
               "steps": [], "averages": []}
        for s in self.shards:
            with s.lock:
                out["values"].append(s.param.detach().clone())
                out["averages"].append(None if s.avg is None else s.avg.clone())
                out["optimizer"].append(copy.deepcopy(s.opt.state_dict()))
                out["versions"].append(s.version)
                out["steps"].append(s.steps)
        return out

    def load_state_dict(self, state: dict, start_epoch: int = 0) -> None:
        """Restore ``state_dict()``'s output (before any worker arrives); the workers then
        start at epoch ``start_epoch`` (their hello tells them so)."""
        if list(state["bounds"]) != self.bounds:
            raise ValueError(f"the saved server has shards {state['bounds']}, this one "
                             f"{self.bounds}: a different model or partitioning")
        averages = state.get("averages") or [None] * len(self.shards)  # older checkpoints
        for s, values, opt, version, steps, saved in zip(
                self.shards, state["values"], state["optimizer"], state["versions"],
                state["steps"], averages):
            with s.lock:
                s.param.data.copy_(values)
                if s.avg is not None:          # none saved: the average starts at x
                    s.avg.copy_(values if saved is None else saved)
                s.opt.load_state_dict(opt)
                s.version, s.steps = int(version), int(steps)
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
                "pushes": self.pushes, "pulls": self.pulls, "dropped_stale": self.dropped,
                "max_staleness": self.max_staleness, "held_back_pushes": self.waits,
                "rejected_connections": self.rejected,
                "staleness_histogram": dict(sorted(self.staleness.items())),
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "push_seconds": self.push_seconds, "pull_seconds": self.pull_seconds}

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for s in self.shards:
            with s.lock:
                s.lock.notify_all()
        with self._clock_cv:
            self._clock_cv.notify_all()
        with self._hello:
            self._hello.notify_all()
        with self._epochs_cv:
            self._epochs_cv.notify_all()
        self._thread.join(timeout=2)

    # -- serving -------------------------------------------------------------------------
    def _serve(self):
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(sock,), daemon=True).start()

    def _handle(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(16)
        conn = _Conn(sock, self.secret, nonce)
        buf = _Growing()
        with sock:
            try:
                sock.settimeout(self.timeout_s)
                sock.sendall(nonce)
                while not self._stop.is_set():
                    frame = conn.recv(self.max_payload, buf)
                    if not self._dispatch(conn, *frame):
                        break
            except (PSError, ValueError, KeyError, IndexError) as e:
                with self._stats_lock:
                    self.rejected += 1
                try:
                    conn.send(OPS["error"], str(e).encode()[:4000])
                except OSError:
                    pass
            except OSError:
                pass                                     # peer went away (e.g. a killed task)
            finally:
                with self._stats_lock:
                    self.bytes_in += conn.bytes_received
                    self.bytes_out += conn.bytes_sent

    def _dispatch(self, conn, op, code, steps, worker, shard, version, count, payload) -> bool:
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
            return False
        if op == OPS["hello"]:
            return self._on_hello(conn, worker, payload)
        if op == OPS["key"]:
            if self.keys is None or bound is None:
                raise PSError("a key request needs a fit with data keys and a hello first")
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
            with s.lock:
                values, v = s.param.detach().clone(), s.version
            with self._stats_lock:
                self.pulls += 1
            conn.send(OPS["ok"], values.to(DTYPES[code] if code in (0, 1, 2) else self.dtype),
                      shard=shard, version=v)
            with self._stats_lock:
                self.pull_seconds += time.perf_counter() - t0
            return True
        if op in (OPS["push"], OPS["pushpull"]):
            t0 = time.perf_counter()
            if code == 3:
                raise PSError("gradients must be float32, float64 or bfloat16")
            itemsize = torch.empty((), dtype=DTYPES[code]).element_size()
            if len(payload) != s.param.numel() * itemsize:
                raise PSError(f"push to shard {shard}: {len(payload)} bytes, expected "
                              f"{s.param.numel() * itemsize}")
            raw = torch.frombuffer(payload, dtype=torch.uint8)
            grad = raw.view(DTYPES[code]).to(self.dtype)
            if not torch.isfinite(grad.sum()) and not torch.isfinite(grad).all():
                raise PSError(f"push to shard {shard} holds NaN or inf; the worker diverged "
                              f"(lower the learning rate)")
            if shard == 0 and self.max_staleness is not None:
                self._wait_for_slowest(worker)
            pull = op == OPS["pushpull"]         # the reply carries the shard after the push
            new_version, staleness, values = self._push(s, worker, grad, version, count,
                                                        max(steps, 1), pull)
            with self._stats_lock:               # counted before the reply: a caller that
                self.pushes += 1                  # got its answer sees its push counted
                self.pulls += pull
                self.push_seconds += time.perf_counter() - t0
            conn.send(OPS["ok"], None if values is None else values.to(DTYPES[code]),
                      shard=shard, version=new_version, count=staleness)
            return True
        raise PSError(f"unknown op {op}")

    def _on_hello(self, conn, worker, payload) -> bool:
        if len(payload) not in (16, 40):
            raise PSError("hello carries [rows, batch_size] (and a profile [a_ps, c_ps, cap]) "
                          "as int64")
        info = np.frombuffer(payload, np.int64)
        conn.worker = worker
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
        from ..balance import equal_time_split
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

    def _push(self, s: _Shard, worker: int, grad: torch.Tensor, base: int, samples: int,
              steps: int, pull: bool = False):
        """Apply (or collect) one push; returns (version, staleness, and with ``pull`` the
        shard's values after it, copied under the lock so that they belong to that version)."""
        with s.lock:
            staleness = s.version - base
            if self.keys is not None:            # a push of a key this worker must hold
                epoch = self.keys.epoch
                if self.keys.applied(worker) is None:
                    self.dropped += 1
                    return s.version, staleness, s.param.detach().clone() if pull else None
            if self.mode != "sync":
                self.staleness[staleness] += 1
                # the sum of per-sample gradients of `steps` mini-batches -> `steps` x their mean
                scale = steps / max(samples, 1)
                if self.staleness_lr and staleness > 1:
                    scale /= staleness
                s.apply(grad, scale, steps, self.epoch_steps, summed=steps)
                s.done[worker] += steps
                if self.keys is not None and self.keys.epoch > epoch:   # the epoch's last key
                    state = self.state_dict()
                    with self._epochs_cv:
                        self.epoch_states[epoch + 1] = state
                        self._epochs_cv.notify_all()
                return s.version, staleness, s.param.detach().clone() if pull else None
            if staleness > 0:                     # computed on an older round: dropped
                self.dropped += 1
                return s.version, staleness, s.param.detach().clone() if pull else None
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
            return s.version, 0, s.param.detach().clone() if pull else None


class PSClient:
    """A worker's connection to the parameter server (one request at a time)."""

    def __init__(self, address, secret: bytes, worker: int, dtype: torch.dtype = torch.float32,
                 timeout_s: float = 300.0):
        self.worker, self.dtype = worker, dtype
        sock = socket.create_connection(tuple(address), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = bytes(_recv_exact(sock, 16))
        self.conn = _Conn(sock, secret, nonce)
        self.bounds: list[int] = []
        self.versions: list[int] = []
        self.done_steps = 0                       # set by hello
        self.shard_done: list[int] = []           # set by hello: per shard
        self._skip: list[int] = []                # steps whose push a shard already has
        self.push_seconds = self.pull_seconds = 0.0

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
        """Data keys: ("key", key, epoch), ("wait", milliseconds, 0) or ("finished", 0, 0)."""
        self.conn.send(OPS["key"], worker=self.worker)
        _, _, _, _, payload = self._reply(24)
        status, a, b = (int(v) for v in np.frombuffer(payload, np.int64))
        return ("key", "wait", "finished")[status], a, b

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
        t0 = time.perf_counter()
        rows = self._layout(shards, out.numel())
        for i, _, _ in rows:
            self.conn.send(OPS["pull"], worker=self.worker, shard=i,
                           code=DTYPE_CODES[out.dtype])
        for i, size, off in rows:
            self._read_values(i, out[off:off + size])
        self.pull_seconds += time.perf_counter() - t0

    def _read_values(self, i: int, out: torch.Tensor) -> int:
        """Read shard i's values into ``out`` (its size); returns the reply's count."""
        item, n = out.element_size(), out.numel()
        raw = memoryview(out.view(torch.uint8).numpy())
        _, shard, version, count, payload = self._reply(n * item, raw)
        if shard != i or len(payload) != n * item:
            raise PSError(f"reply for shard {i}: shard {shard} with {len(payload)} bytes, "
                          f"expected {n * item}")
        self.versions[i] = version
        return count

    def push(self, grad_sum: torch.Tensor, samples: int, steps: int = 1,
             pull_into: torch.Tensor | None = None, shards: list[int] | None = None,
             versions: list[int] | None = None) -> list[int]:
        """Push the per-sample gradient sum of ``steps`` mini-batches (``samples`` in all) of
        the shards (default: all; ``grad_sum`` holds them one after the other); returns the
        staleness per shard. With ``pull_into`` (as ``grad_sum``, of the wire dtype) every
        shard's reply carries its values after the push: one round trip, not two.
        ``versions``: the shard versions the gradient was computed on (default: the last
        ones pulled), for the staleness count."""
        if pull_into is not None and pull_into.dtype != self.dtype:
            raise ValueError(f"pull_into must be {self.dtype}, the wire dtype")
        t0 = time.perf_counter()
        rows = self._layout(shards, grad_sum.numel())
        op = OPS["push"] if pull_into is None else OPS["pushpull"]
        stale, skipped = [], []
        for i, size, off in rows:
            if self._skip[i] > 0:            # this shard has the step already (see hello)
                self._skip[i] = max(self._skip[i] - steps, 0)
                skipped.append((i, size, off))
                continue
            g = grad_sum[off:off + size]
            self.conn.send(op, g if g.dtype == self.dtype else g.to(self.dtype),
                           worker=self.worker, shard=i,
                           version=(versions or self.versions)[i], count=samples, steps=steps)
            if pull_into is not None:    # large replies: one shard at a time, so that the
                stale.append(self._read_values(i, pull_into[off:off + size]))  # peers never
        if pull_into is None:            # both block writing; small replies: all pushes
            for _ in range(len(rows) - len(skipped)):        # went out, now read them
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
