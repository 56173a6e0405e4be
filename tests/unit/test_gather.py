"""The driver's gathering of a barrier stage's task statuses (transport/channel.py): one
verdict per round for every task, statuses or "fall back to allGather", over the fit's
authenticated channel. Real sockets and threads; the Spark side is in test_allreduce."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from spark_dl.transport.channel import MessageServer, StatusGather, gather_statuses, pack

SECRET = b"k" * 32


@pytest.fixture
def server():
    got: list[dict] = []
    srv = MessageServer("127.0.0.1", SECRET, got.append)
    srv.gather.patience_s = 1.0
    yield srv, got
    srv.close()


def ask(srv, key, world, ranks, secret=SECRET):
    """Each rank asks from a thread of its own; their answers in rank order."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [pool.submit(gather_statuses, srv.address, secret, key, r, world,
                               {"rank": r, "port": 100 + r}) for r in ranks]
        return [f.result(timeout=30) for f in futures]


def test_every_task_gets_every_status_in_rank_order(server):
    srv, got = server
    answers = ask(srv, "stage 3", 4, [2, 0, 3, 1])
    want = [{"rank": r, "port": 100 + r} for r in range(4)]
    assert answers == [want] * 4
    assert got == []                       # not a progress message: the handler never sees it
    # the same stage asked again (Spark retrying it): a new round, answered afresh
    assert ask(srv, "stage 3", 2, [1, 0]) == [want[:2]] * 2


def test_a_task_that_never_joins_makes_every_task_fall_back(server):
    srv, _ = server
    assert ask(srv, "stage 4", 3, [0, 2]) == [None, None]       # after patience_s
    # the round stays fallen back: a late task, or a retry of the stage, falls back too
    assert ask(srv, "stage 4", 3, [1]) == [None]
    assert srv.gather.fell_back == 1


@pytest.mark.parametrize("bad", ["rank twice", "other world", "rank out of range"])
def test_a_message_that_does_not_fit_the_round_makes_it_fall_back(server, bad):
    srv, _ = server
    second = {"rank twice": (0, 2), "other world": (1, 3), "rank out of range": (5, 2)}[bad]
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(gather_statuses, srv.address, SECRET, "s", 0, 2, {})
        while not srv.gather._rounds:                   # rank 0 has joined
            threading.Event().wait(0.01)
        other = pool.submit(gather_statuses, srv.address, SECRET, "s", second[0], second[1],
                            {})
        assert (first.result(timeout=10), other.result(timeout=10)) == (None, None)


def test_an_unreachable_driver_means_allgather_and_a_wrong_key_gets_no_answer(server):
    srv, _ = server
    with socket.socket() as s:                          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert gather_statuses(("127.0.0.1", port), SECRET, "s", 0, 1, {}, connect_s=1) is None
    # a task with the wrong key is dropped by the driver (the question went out, no answer):
    # it must fail rather than guess which way its peers went
    with pytest.raises(ConnectionError, match="without an answer"):
        gather_statuses(srv.address, b"x" * 32, "s", 0, 1, {})
    assert srv.rejected == 1


def test_closing_the_server_answers_waiting_tasks_with_fall_back():
    srv = MessageServer("127.0.0.1", SECRET, lambda m: None)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(gather_statuses, srv.address, SECRET, "s", 0, 2, {})
        while not srv.gather._rounds:
            threading.Event().wait(0.01)
        srv.close()
        assert waiting.result(timeout=10) is None


def test_progress_messages_still_reach_the_handler(server):
    srv, got = server
    with socket.create_connection(srv.address) as s:
        s.sendall(pack(SECRET, {"type": "step", "n": 1}))
    for _ in range(200):
        if got:
            break
        threading.Event().wait(0.01)
    assert got == [{"type": "step", "n": 1}]


def test_the_gather_alone_decides_once_per_round():
    g = StatusGather(patience_s=5)
    stop = threading.Event()
    one = g.join({"key": "k", "rank": 0, "world": 1, "status": {"a": 1}}, stop)
    assert one["statuses"] == [{"a": 1}] and one["rank"] == 0


def test_a_peer_that_sends_nothing_is_let_go_and_the_channel_serves_on(server):
    """A connection's first valid message must come within ``arrivals.seconds``, and at
    most ``arrivals.most`` connections wait for theirs at once: a third is closed at once,
    the silent ones when their time is up, and a task's progress message still arrives."""
    srv, got = server
    srv.arrivals.seconds, srv.arrivals.most = 1.0, 2
    silent = [socket.create_connection(srv.address, timeout=5) for _ in range(2)]
    silent[1].sendall(b"\x00")                     # a byte of a frame, never the rest
    third = socket.create_connection(srv.address, timeout=5)
    third.settimeout(1.0)
    assert third.recv(1) == b""                    # closed unserved
    for s in silent:
        s.settimeout(3.0)
        assert s.recv(1) == b""                    # shut when its second is up
        s.close()
    third.close()
    assert srv.arrivals.turned_away == 3
    with socket.create_connection(srv.address, timeout=5) as ok:
        ok.sendall(pack(SECRET, {"type": "step", "loss": 1.0}))
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == [{"type": "step", "loss": 1.0}]
