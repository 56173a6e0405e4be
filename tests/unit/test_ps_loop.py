"""The parameter server's event loop (spark_dl.transport.ps.loop): once a worker's hello is
done, one thread serves its frames, and no worker can hold up the others."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from spark_dl.transport.ps import ParameterServer, PSClient, PSError
from spark_dl.transport.ps.server import LOOP_FROM
from spark_dl.transport.ps.wire import OPS

from .conftest import SECRET, in_threads


@pytest.fixture
def server(ps_servers):
    """test_ps.py's servers, serving from the loop unless the test gives ``workers`` (then
    LOOP_FROM decides) or ``loop``."""
    def make(n=1000, **kw):
        kw.setdefault("loop", None if "workers" in kw else True)
        return ps_servers(n, **kw)
    return make


def _client(ps, worker: int) -> PSClient:
    c = PSClient(ps.address, SECRET, worker, dtype=torch.float64, timeout_s=10)
    c.hello(rows=100, batch_size=1)
    return c


def _frame(c: PSClient, op: int, payload: torch.Tensor, **kw) -> bytes:
    """The bytes ``c`` would send for this frame (its sequence number moves on)."""
    out = []
    c.conn.sink = lambda head, view: out.append(bytes(head) + bytes(view))
    try:
        c.conn.send(op, payload, worker=c.worker, **kw)
    finally:
        c.conn.sink = None
    return out[0]


def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["async", "sequential"])
def test_after_the_hello_one_thread_serves_every_worker(server, mode):
    ps = server(n=1000, optimizer="sgd", lr=0.1, mode=mode, workers=16)
    initial = ps.parameters()
    clients = [_client(ps, w) for w in range(16)]
    _until(lambda: ps.connections.loop.connections == 16)
    # the connections' own threads have handed them over and ended
    _until(lambda: not [t for t in threading.enumerate() if "_handle" in t.name])
    grads = torch.randn(16, 30, 1000, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(0))

    def pushes(w):
        out = torch.empty(1000, dtype=torch.float64)
        for k in range(30):
            clients[w].push(grads[w, k], samples=1, pull_into=out)
    errors = in_threads(pushes, 16)
    assert not errors and ps.versions == [480] and ps.pushes == 480
    assert torch.allclose(ps.parameters(), initial - 0.1 * grads.sum(dim=(0, 1)), atol=1e-9)
    for c in clients[:8]:
        c.close()                                   # bye: the loop closes those
    _until(lambda: ps.connections.loop.connections == 8)
    ps.close()                                      # and the server the others
    with pytest.raises((PSError, ConnectionError, OSError)):
        clients[8].push(grads[8, 0], samples=1, pull_into=torch.empty(1000, dtype=torch.float64))


def test_a_worker_stalled_mid_frame_holds_up_nobody(server):
    ps = server(n=1000, optimizer="sgd", lr=0.1)
    initial = ps.parameters()
    a, b = _client(ps, 0), _client(ps, 1)
    frame = _frame(a, OPS["pushpull"], torch.ones(1000, dtype=torch.float64), count=1,
                   steps=1)
    a.conn.sock.sendall(frame[:100])              # the header and a few values, then nothing
    out = torch.empty(1000, dtype=torch.float64)
    b.push(torch.full((1000,), 2.0, dtype=torch.float64), samples=1, pull_into=out)
    assert ps.versions == [1] and torch.allclose(out, initial - 0.2)
    a.conn.sock.sendall(frame[100:])
    mine = torch.empty(1000, dtype=torch.float64)
    a._read_values(0, mine)
    assert ps.versions == [2] and torch.allclose(mine, initial - 0.3)


def test_a_worker_killed_mid_frame_is_dropped_and_its_retry_served(server):
    """A task killed in the middle of a push (its socket closed, no bye) leaves nothing
    applied; Spark's retry connects again under its worker id and goes on from the steps the
    server has."""
    ps = server(n=1000, optimizer="sgd", lr=0.1)
    initial = ps.parameters()
    a = _client(ps, 3)
    out = torch.empty(1000, dtype=torch.float64)
    a.push(torch.ones(1000, dtype=torch.float64), samples=1, pull_into=out)
    frame = _frame(a, OPS["pushpull"], torch.ones(1000, dtype=torch.float64), count=1,
                   steps=1)
    a.conn.sock.sendall(frame[:500])
    a.conn.sock.close()                               # killed mid-frame
    _until(lambda: ps.connections.loop.connections == 0)
    retry = PSClient(ps.address, SECRET, 3, dtype=torch.float64, timeout_s=10)
    retry.hello(rows=100, batch_size=1)
    assert retry.done_steps == 1 and ps.versions == [1]
    retry.push(torch.ones(1000, dtype=torch.float64), samples=1, pull_into=out)
    assert ps.versions == [2] and torch.allclose(out, initial - 0.2)
    _until(lambda: ps.connections.loop.connections == 1)
    assert ps.connections.rejected == 0


def test_a_reply_the_socket_cannot_take_at_once_waits_for_its_reader(server):
    """A worker that sends a push and reads the reply late (Downpour's overlap) does not stall
    the loop: its 32 MB reply is written as it reads, and the others are served meanwhile."""
    n = 4 << 20
    ps = server(n=n, optimizer="sgd", lr=0.5)
    initial = ps.parameters()
    a, b = _client(ps, 0), _client(ps, 1)
    a.conn.sock.sendall(_frame(a, OPS["pushpull"], torch.ones(n, dtype=torch.float64),
                               count=1, steps=1))
    _until(lambda: ps.versions == [1])
    out = torch.empty(n, dtype=torch.float64)
    b.push(torch.full((n,), 2.0, dtype=torch.float64), samples=1, pull_into=out)
    assert ps.versions == [2] and torch.allclose(out, initial - 1.5)
    late = torch.empty(n, dtype=torch.float64)
    a._read_values(0, late)                          # the values right after a's own push
    assert a.versions == [1] and torch.allclose(late, initial - 0.5)


def test_a_bad_frame_after_the_hello_closes_that_connection_only(server):
    ps = server(n=100, optimizer="sgd", lr=1.0)
    before = ps.parameters()
    bad, good = _client(ps, 0), _client(ps, 1)
    frame = bytearray(_frame(bad, OPS["push"], torch.ones(100, dtype=torch.float64), count=1,
                             steps=1))
    frame[60] ^= 0xFF                                # the MAC no longer matches
    bad.conn.sock.sendall(bytes(frame))
    with pytest.raises(PSError, match="bad MAC"):
        bad._reply(0)
    with pytest.raises((ConnectionError, OSError)):
        bad._reply(0)                                # and the connection is gone
    nan = _client(ps, 2)
    with pytest.raises(PSError, match="NaN or inf"):
        nan.push(torch.full((100,), float("nan"), dtype=torch.float64), samples=1)
    assert ps.connections.rejected == 2 and ps.versions == [0]
    out = torch.empty(100, dtype=torch.float64)
    good.pull(out)
    assert torch.equal(out, before)
    _until(lambda: ps.connections.loop.connections == 1)


def test_which_servers_serve_from_the_loop(server):
    """From 8 workers on (a thread each below: a waiting worker's thread runs on its idle
    core), and only where no push waits for another worker's and one shard takes them all."""
    assert server(mode="async", workers=2).connections.loop is None
    assert server(mode="async", workers=LOOP_FROM).connections.loop is not None
    assert server(mode="sequential", workers=16).connections.loop is not None
    assert server(mode="async", workers=2, loop=True).connections.loop is not None
    assert server(mode="async", workers=16, loop=False).connections.loop is None
    assert server(mode="sync", workers=16, loop=True).connections.loop is None
    assert server(mode="async", workers=16, max_staleness=2).connections.loop is None
    assert server(workers=16, shards=4).connections.loop is None    # big models: shards in parallel


def _echo(conn, op, code, steps, worker, shard, version, count, payload):
    """A dispatch for the loop alone: worker 0's requests fail (a fault of the server's, not
    a bad request), the others' payloads come back."""
    if worker == 0:
        raise ZeroDivisionError("a bug")
    conn.send(OPS["ok"], bytes(payload))
    return True


def _pair(loop=None):
    """(the server's end, the worker's end) of a connection, the first adopted by ``loop``."""
    import socket

    from spark_dl.transport.ps.wire import Conn
    a, b = socket.socketpair()
    b.settimeout(10)
    server_side, worker_side = Conn(a, SECRET, b"n" * 16), Conn(b, SECRET, b"n" * 16)
    if loop is not None:
        loop.adopt(server_side)
    return server_side, worker_side


def test_a_fault_serving_one_worker_is_told_to_it_and_the_loop_serves_on():
    """A dispatch that fails (a server bug, not a bad request) closes that connection with an
    error frame naming it; the loop thread lives on for the others."""
    from spark_dl.transport.ps.loop import EventLoop
    refused, closed = [], []
    loop = EventLoop(_echo, 1 << 10, refused.append, closed.append)
    try:
        _, bad = _pair(loop)
        _, good = _pair(loop)
        bad.send(OPS["push"], b"x" * 8, worker=0)
        op, *_, payload = bad.recv(1 << 10)
        assert op == OPS["error"] and bytes(payload).decode() == (
            "the parameter server failed serving this request: ZeroDivisionError: a bug")
        with pytest.raises(ConnectionError):
            bad.recv(1 << 10)                     # and the connection is closed
        good.send(OPS["push"], b"hello", worker=1)
        op, *_, payload = good.recv(1 << 10)
        assert op == OPS["ok"] and bytes(payload) == b"hello"
        assert not refused and len(closed) == 1
    finally:
        loop.close()


def test_frames_a_turn_leaves_in_the_buffer_are_served_next_turn():
    """A peer's frames beyond one turn's share (8) that one receive already brought in are
    served on the next turns, though no new byte arrives for them."""
    from spark_dl.transport.ps.loop import _FRAMES_PER_TURN, EventLoop
    refused, closed = [], []
    loop = EventLoop(_echo, 1 << 10, refused.append, closed.append)
    try:
        server_side, worker = _pair()
        n = 2 * _FRAMES_PER_TURN + 3
        for i in range(n):                        # all sent before the loop reads any
            worker.send(OPS["push"], str(i).encode(), worker=1)
        loop.adopt(server_side)
        got = [bytes(worker.recv(1 << 10)[-1]).decode() for _ in range(n)]
        assert got == [str(i) for i in range(n)]
    finally:
        loop.close()


def test_a_connection_handed_over_as_the_loop_closes_is_closed_not_left():
    from spark_dl.transport.ps.loop import EventLoop
    refused, closed = [], []
    loop = EventLoop(_echo, 1 << 10, refused.append, closed.append)
    loop.close()
    server_side, worker = _pair(loop)             # a hello that finished just now
    assert closed == [server_side]
    with pytest.raises((ConnectionError, OSError)):
        worker.send(OPS["push"], b"x", worker=1)
        worker.recv(1 << 10)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_fault_of_the_threaded_server_closes_that_workers_connection(server):
    """Below LOOP_FROM (a thread per connection) too: a fault of the server's own closes the
    connection at once, the worker does not wait out its timeout for a reply."""
    ps = server(n=10, mode="async", workers=2)
    assert ps.connections.loop is None

    def fault(*frame):
        raise ZeroDivisionError("a bug")
    ps._dispatch = fault
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64, timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(PSError, match="failed serving this request: ZeroDivisionError: a bug"):
        c.hello(rows=1, batch_size=1)
    with pytest.raises((ConnectionError, OSError)):
        c._reply(0)                               # and the connection is closed
    assert time.monotonic() - t0 < 20             # at once, not after the 30 s timeout
    _until(lambda: ps.stats()["bytes_in"] > 0)    # and counted as closed
    # its thread ends with the fault's traceback: within this test, whose mark expects it
    _until(lambda: not [t for t in threading.enumerate() if "_handle" in t.name])


def test_a_worker_that_reads_no_replies_is_not_read_either():
    """The loop reads no more frames from a worker whose replies wait for its socket: 125
    pulls of 800 KB each, never read, leave at most one reply queued, not 100 MB."""
    from spark_dl.transport.ps.wire import DTYPE_CODES
    ps = ParameterServer(torch.zeros(100_000, dtype=torch.float64), SECRET, workers=8,
                         loop=True)
    try:
        c = PSClient(ps.address, SECRET, 0, dtype=torch.float64, timeout_s=10)
        c.hello(rows=10, batch_size=1)
        for _ in range(125):
            c.conn.send(OPS["pull"], worker=0, shard=0, code=DTYPE_CODES[torch.float64])
        time.sleep(1.0)
        peers = list(ps.connections.loop._peers)
        assert len(peers) == 1 and len(peers[0].out) <= 2
        out = torch.empty(100_000, dtype=torch.float64)
        for _ in range(125):                     # every reply comes, in order, once read
            assert len(c._reply(1 << 21)[-1]) == 800_000
        c.pull(out)
        assert torch.equal(out, torch.zeros(100_000, dtype=torch.float64))
    finally:
        ps.close()
