"""The parameter server over real sockets: load, modes, and hostile peers."""

from __future__ import annotations

import re
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch

from spark_dl.transport.ps import KeyLeases, ParameterServer, PSClient, PSError, StepRule
from spark_dl.transport.ps.wire import HEADER_BYTES, MAGIC, OPS

from .conftest import SECRET, in_threads


@pytest.fixture
def server(ps_servers):
    return ps_servers


def test_32_clients_x_20_pushes_apply_every_update(server):
    ps = server(n=1000, shards=4, optimizer="sgd", lr=0.1)
    initial = ps.parameters()
    grads = torch.randn(32, 20, 1000, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(0))

    def worker(w):
        c = PSClient(ps.address, SECRET, w, dtype=torch.float64)
        c.hello(rows=20, batch_size=1)
        for k in range(20):
            c.push(grads[w, k], samples=1)
        c.close()
    errors = in_threads(worker, 32)
    assert not errors
    assert ps.versions == [640] * 4 and ps.pushes == 640 * 4
    expected = initial - 0.1 * grads.sum(dim=(0, 1))
    assert torch.allclose(ps.parameters(), expected, atol=1e-9)
    assert sum(ps.staleness.values()) == 640 * 4


def test_a_reconnecting_worker_is_told_the_steps_already_applied(server):
    """A task Spark retries registers under its worker id again: the hello reply carries the
    mini-batch steps the server applied for that id, where the retried task goes on from."""
    ps = server(n=10, shards=2, optimizer="sgd", lr=0.1)
    first = PSClient(ps.address, SECRET, 3, dtype=torch.float64)
    first.hello(rows=40, batch_size=4)
    assert first.done_steps == 0
    for _ in range(3):
        first.push(torch.ones(10, dtype=torch.float64), samples=8, steps=2)
    first.conn.sock.close()                     # killed: no bye
    again = PSClient(ps.address, SECRET, 3, dtype=torch.float64)
    assert again.hello(rows=40, batch_size=4) == 10 and again.done_steps == 6
    other = PSClient(ps.address, SECRET, 4, dtype=torch.float64)
    other.hello(rows=40, batch_size=4)
    assert other.done_steps == 0
    again.close()
    other.close()


def test_pull_returns_the_current_values_and_versions(server):
    ps = server(n=10, shards=3, optimizer="sgd", lr=1.0)
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    c.hello(rows=5, batch_size=5)
    c.push(torch.ones(10, dtype=torch.float64) * 4, samples=2)      # mean gradient 2
    out = torch.empty(10, dtype=torch.float64)
    c.pull(out)
    assert torch.allclose(out, torch.linspace(-1, 1, 10, dtype=torch.float64) - 2)
    assert c.versions == [1, 1, 1]
    # a push computed on version 1 after another push: staleness 1
    c2 = PSClient(ps.address, SECRET, 1, dtype=torch.float64)
    c2.hello(rows=5, batch_size=5)
    c2.push(torch.zeros(10, dtype=torch.float64), samples=1)         # c2 never pulled
    assert c.push(torch.zeros(10, dtype=torch.float64), samples=1) == [1, 1, 1]
    assert ps.staleness[1] == 6           # both pushes came one version late, on 3 shards
    c.close()
    c2.close()


def test_pull_newer_sends_only_the_shards_another_worker_moved(server):
    ps = server(n=10, shards=3, optimizer="sgd", lr=1.0)
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    c.hello(rows=5, batch_size=5)
    out = torch.empty(10, dtype=torch.float64)
    c.pull(out)
    pulls, received = ps.pulls, c.conn.bytes_received
    out.fill_(7.0)
    assert c.pull_newer(out) == []                         # nothing moved: headers only
    assert torch.equal(out, torch.full((10,), 7.0, dtype=torch.float64))
    assert ps.pulls == pulls and c.conn.bytes_received - received == 3 * HEADER_BYTES
    c2 = PSClient(ps.address, SECRET, 1, dtype=torch.float64)
    c2.hello(rows=5, batch_size=5)
    c2.pull(torch.empty(10, dtype=torch.float64))
    pulls = ps.pulls
    lo, hi = c.bounds[1], c.bounds[2]
    c2.push(torch.ones(hi - lo, dtype=torch.float64), samples=1, shards=[1])   # shard 1 only
    assert c.pull_newer(out) == [(lo, hi - lo)]          # the moved shard's range in out
    start = torch.linspace(-1, 1, 10, dtype=torch.float64)
    assert torch.equal(out[lo:hi], start[lo:hi] - 1)      # the moved shard's new values
    assert torch.equal(out[:lo], torch.full((lo,), 7.0, dtype=torch.float64))   # the rest
    assert torch.equal(out[hi:], torch.full((10 - hi,), 7.0, dtype=torch.float64))
    assert c.versions == [0, 1, 0] and ps.pulls == pulls + 1     # one shard's values sent
    assert c.pull_newer(out) == [] and c.newer_asks == 3
    c.close()
    c2.close()


@pytest.mark.parametrize("wire_dtype", [torch.float32, torch.bfloat16])
def test_rebase_takes_the_servers_new_values_less_the_keys_local_steps(server, wire_dtype):
    # Boosting's fresh values mid-key (strategies/boosting/task.py): a worker's copy after
    # local steps `moved` becomes the server's values less `moved` once another worker has
    # pushed, and stays as it is while nobody has; float32 on the wire is the worker's own
    # copy (direct), bfloat16 a separate buffer (amp, or a GPU copy)
    from spark_dl.strategies.boosting.task import rebase
    ps = server(n=10, shards=1, optimizer="sgd", lr=1.0)
    a = PSClient(ps.address, SECRET, 0, dtype=wire_dtype)
    a.hello(rows=5, batch_size=5)
    flat = torch.empty(10)
    wire = flat if wire_dtype == torch.float32 else torch.empty(10, dtype=wire_dtype)
    a.pull(wire)
    flat.copy_(wire)
    moved = torch.linspace(0.1, 1.0, 10)              # the key's local steps so far
    flat.sub_(moved)
    before = flat.clone()
    assert rebase(a, wire, flat, moved) == 0 and torch.equal(flat, before)
    b = PSClient(ps.address, SECRET, 1, dtype=torch.float64)
    b.hello(rows=5, batch_size=5)
    b.push(torch.full((10,), 3.0, dtype=torch.float64), samples=1)    # the server moves by -3
    assert rebase(a, wire, flat, moved) == 1
    new = (torch.linspace(-1, 1, 10, dtype=torch.float64) - 3).to(wire_dtype).float()
    assert torch.equal(flat, new - moved)
    assert rebase(a, wire, flat, moved) == 0 and torch.equal(flat, new - moved)
    b.push(torch.full((10,), 1.0, dtype=torch.float64), samples=1)
    assert rebase(a, wire, flat, None) == 1               # no local steps: the values
    assert torch.equal(flat, (torch.linspace(-1, 1, 10, dtype=torch.float64) - 4)
                       .to(wire_dtype).float())
    assert a.newer_asks == 4
    a.close()
    b.close()


def test_push_with_pull_returns_each_shard_after_the_push(server):
    ps = server(n=10, shards=3, optimizer="sgd", lr=1.0)
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    c.hello(rows=5, batch_size=5)
    other = PSClient(ps.address, SECRET, 1, dtype=torch.float64)
    other.hello(rows=5, batch_size=5)
    other.push(torch.ones(10, dtype=torch.float64), samples=1)       # c has not seen it
    out = torch.full((10,), float("nan"), dtype=torch.float64)
    assert c.push(torch.ones(10, dtype=torch.float64) * 4, samples=2, pull_into=out) == [1] * 3
    assert torch.equal(out, ps.parameters())                          # both pushes in it
    assert torch.allclose(out, torch.linspace(-1, 1, 10, dtype=torch.float64) - 3)
    assert c.versions == [2, 2, 2] and ps.pulls == 3
    with pytest.raises(ValueError, match=r"pull_into must be torch.float64"):
        c.push(torch.zeros(10, dtype=torch.float64), samples=1, pull_into=out.float())
    c.close()
    other.close()


def test_a_connection_speaks_for_the_worker_it_registered(server):
    ps = server(n=4, optimizer="sgd", lr=1.0)
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    c.hello(rows=4, batch_size=2)
    c.worker = 1                                    # pretend to be another worker
    with pytest.raises(PSError, match="registered as worker 0, a frame says 1"):
        c.push(torch.ones(4, dtype=torch.float64), samples=1)
    assert ps.versions == [0]


def test_learning_rate_decays_per_epoch_of_pushed_steps(server):
    ps = server(n=4, optimizer="sgd", lr=1.0, lr_decay=0.5, workers=2)
    a, b = (PSClient(ps.address, SECRET, w, dtype=torch.float64) for w in (0, 1))
    assert a.hello(rows=4, batch_size=2) == 2 and b.hello(rows=2, batch_size=2) == 1
    start = ps.parameters()
    g = torch.ones(4, dtype=torch.float64)
    # an epoch is 3 steps of all workers: lr 1 for steps 0-2, 0.5 for steps 3-5 (a push of 2
    # steps is one update of twice the size), 0.25 from step 6
    for client, steps in ((a, 1), (b, 1), (a, 1), (b, 2), (a, 1), (a, 1)):
        client.push(g * steps, samples=steps, steps=steps)
    assert torch.allclose(ps.parameters(), start - (3 * 1 + 0.5 * 2 + 0.5 + 0.25))
    a.close()
    b.close()


def test_sync_mode_takes_the_sample_weighted_mean_once_per_round(server):
    ps = server(n=4, optimizer="sgd", lr=1.0, mode="sync", workers=2)
    results = {}

    def worker(w, grad_sum, samples, rows):
        c = PSClient(ps.address, SECRET, w, dtype=torch.float64)
        results[f"steps{w}"] = c.hello(rows=rows, batch_size=10)
        results[w] = c.push(grad_sum, samples)
        c.close()
    a = threading.Thread(target=worker, args=(0, torch.full((4,), 7.0, dtype=torch.float64),
                                              7, 70))
    b = threading.Thread(target=worker, args=(1, torch.full((4,), 9.0, dtype=torch.float64),
                                              3, 30))
    a.start(), b.start(), a.join(), b.join()
    assert results["steps0"] == results["steps1"] == 7     # the largest shard's steps
    assert ps.versions == [1]
    # (7 + 9) / (7 + 3) = 1.6 per value, one SGD step with lr 1
    assert torch.allclose(ps.parameters(), torch.linspace(-1, 1, 4, dtype=torch.float64) - 1.6)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_killed_between_shards_of_a_push_has_its_step_redone_once(server, mode):
    """Sync mode, two shards: worker 1 dies after its push of step 1 reached shard 0 only, so
    shard 1's round 1 waits for it. The retried task is told the step is done on shard 0 and
    not on shard 1; its redo pushes to shard 1 only, which closes the round, and the run ends
    where an undisturbed one does (async: no shard applies the step twice)."""
    ps = server(n=4, shards=2, optimizer="sgd", lr=1.0, mode=mode, workers=2)
    start = ps.parameters()
    g = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    errors, told = [], {}

    def steps(client, w, first):
        out = torch.empty(4, dtype=torch.float64)
        for k in range(first, 3):
            client.pull(out)
            client.push(g[w, k], samples=1)

    def worker0():
        try:
            c = PSClient(ps.address, SECRET, 0, dtype=torch.float64, timeout_s=20)
            c.hello(rows=3, batch_size=1)
            steps(c, 0, 0)
            c.close()
        except Exception as e:                      # pragma: no cover - reported below
            errors.append(e)

    def worker1():
        try:
            c = PSClient(ps.address, SECRET, 1, dtype=torch.float64, timeout_s=20)
            c.hello(rows=3, batch_size=1)
            out = torch.empty(4, dtype=torch.float64)
            c.pull(out)
            c.push(g[1, 0], samples=1)                         # step 0, whole
            c.pull(out)
            c.conn.send(OPS["push"], g[1, 1][:2], worker=1, shard=0,   # step 1: shard 0 only
                        version=c.versions[0], count=1, steps=1)
            c.conn.sock.close()                                # killed
            deadline = time.monotonic() + 10
            while ps.shards[0].done[1] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)                               # (Spark retries in seconds)
            again = PSClient(ps.address, SECRET, 1, dtype=torch.float64, timeout_s=20)
            again.hello(rows=3, batch_size=1)
            told.update(done=again.done_steps, shards=list(again.shard_done))
            steps(again, 1, again.done_steps)
            again.close()
        except Exception as e:                      # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=worker0), threading.Thread(target=worker1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert told == {"done": 1, "shards": [2, 1]}
    assert [s.done[1] for s in ps.shards] == [3, 3] and ps.dropped == 0
    if mode == "sync":                # every round: the mean of the two workers' gradients
        expected = start - g.mean(0).sum(0)
        assert ps.versions == [3, 3]
    else:                             # every push applied once, in whatever order
        expected = start - g.sum((0, 1))
        assert ps.versions == [6, 6]
    assert torch.allclose(ps.parameters(), expected, atol=1e-12)


@pytest.mark.parametrize("staleness_lr", [True, False])
def test_staleness_aware_server_steps_lr_over_tau(server, staleness_lr):
    """Pushes computed 0, 1, 0 and 3 versions ago: with staleness_lr the last one takes a
    step of lr / 3 (tau <= 1 a full step); without, every push a full step."""
    ps = server(n=4, optimizer="sgd", lr=0.5, staleness_lr=staleness_lr)
    start = ps.parameters()
    g = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    c.hello(rows=4, batch_size=1)
    for grad, base, tau in zip(g, (0, 0, 2, 0), (0, 1, 0, 3)):
        assert c.push(grad, samples=1, versions=[base]) == [tau]
    c.close()
    last = 1 / 3 if staleness_lr else 1.0
    assert torch.allclose(ps.parameters(), start - 0.5 * (g[0] + g[1] + g[2] + last * g[3]),
                          atol=1e-12)
    assert dict(ps.staleness) == {0: 2, 1: 1, 3: 1}



def test_the_staleness_rules_set_the_server_momentum():
    """"halfway": the mean of m' with lr / (1 - m') the single process's effective step
    divided by R (2R when the pushes overlap), not below momentum 0, and the momentum lowered
    by 1 - 1/R; "lr" and "none" keep it; one worker, sync and sequential keep it."""
    from spark_dl.strategies.ps_rules import server_momentum
    halfway = [server_momentum(0.9, r, "async", "halfway") for r in (1, 2, 4, 8, 10, 16)]
    assert halfway == pytest.approx([0.9, 0.6, 0.375, 0.1125, 0.0, 0.0])
    assert server_momentum(0.9, 2, "async", "halfway", overlapped=True) == pytest.approx(0.5)
    assert server_momentum(0.9, 2, "sync", "halfway") == 0.9
    for staleness in ("lr", "none"):
        assert server_momentum(0.9, 4, "async", staleness) == 0.9
    for mode in ("sync", "sequential"):
        assert server_momentum(0.9, 4, mode, "halfway") == 0.9


@pytest.mark.parametrize("removed, instead", [
    ("step", "'halfway'"), ("momentum", "'halfway'"), ("lr+momentum", "'lr'"),
    ("worker", "'dana' \\(the default"), ("worker+short", "'dana' \\(the default")])
def test_a_removed_staleness_rule_names_what_to_use_instead(removed, instead):
    from spark_dl import Boosting, Downpour
    from spark_dl.errors import ConfigError
    from spark_dl.strategies.ps_rules import check_staleness
    match = rf"staleness='{re.escape(removed)}' was removed; use {instead}"
    for check in (check_staleness, lambda v: Downpour(staleness=v),
                  lambda v: Boosting(staleness=v)):
        with pytest.raises(ConfigError, match=match):
            check(removed)


def test_clip_cuts_a_push_to_a_multiple_of_the_running_norm_and_resumes_it(server):
    """SGD lr 1, clip 2: the first 20 steps (norm 1 each) only build the running norm r = 1;
    a push of norm 10 then steps 2 (r <- r + 0.05 (2 - r)), one of norm 1.5 is left alone; a
    server restored from the checkpoint goes on with the same r."""
    ps = server(n=4, optimizer="sgd", lr=1.0, clip=2.0)
    start = ps.parameters()
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    c.hello(rows=4, batch_size=1)
    e = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64)
    for _ in range(20):
        c.push(e, samples=1)
    c.push(10 * e, samples=1)                            # cut to 2
    c.push(1.5 * e, samples=1)                           # under 2 x r: as it is
    assert torch.allclose(ps.parameters(), start - (20 + 2 + 1.5) * e, atol=1e-12)
    r = 1.0 + 0.05 * (2.0 - 1.0)
    r = r + 0.05 * (1.5 - r)
    assert ps.shards[0].norm_mean == pytest.approx(r, rel=1e-12)
    assert ps.stats()["clipped_steps"] == 1 and ps.stats()["clip"] == 2.0
    state = ps.state_dict()
    c.close()
    again = server(n=4, optimizer="sgd", lr=1.0, clip=2.0)
    again.load_state_dict(state)
    d = PSClient(again.address, SECRET, 0, dtype=torch.float64)
    d.hello(rows=4, batch_size=1)
    d.push(10 * e, samples=1)                            # cut at once: r came with the state
    assert torch.allclose(again.parameters(), start - (23.5 + 2 * r) * e, atol=1e-12)
    d.close()
    assert server(n=4, mode="sync", clip=2.0).rule.clip is None   # a round averages: not clipped
    with pytest.raises(ValueError, match="clip must be > 0"):
        server(n=4, clip=0)


def _raw(ps):
    s = socket.create_connection(ps.address, timeout=5)
    nonce = s.recv(16)
    return s, nonce


def _still_serving(ps):
    c = PSClient(ps.address, SECRET, 99, dtype=torch.float64)
    c.hello(rows=1, batch_size=1)
    out = torch.empty(ps.numel, dtype=torch.float64)
    c.pull(out)
    c.close()
    return out


def test_hostile_peers_are_rejected_and_change_nothing(server):
    ps = server(n=100, shards=2, optimizer="sgd", lr=1.0)
    before = ps.parameters()
    # a client without the secret
    bad = PSClient(ps.address, b"wrong secret", 0, dtype=torch.float64)
    with pytest.raises((PSError, ConnectionError, OSError)):
        bad.hello(rows=1, batch_size=1)
        bad.push(torch.ones(100, dtype=torch.float64), samples=1)
    # a truncated frame
    s, _ = _raw(ps)
    s.sendall(MAGIC + b"\x03\x01")
    s.close()
    # a frame claiming 10 GB (with a wrong MAC and with no payload)
    s, _ = _raw(ps)
    head = struct.pack("!4sBBHIIqqQ", MAGIC, OPS["push"], 1, 1, 0, 0, 0, 1, 10 * 2**30)
    s.sendall(head + b"\x00" * 32)
    assert s.recv(1 << 16) is not None
    s.close()
    # 10,000 random frames over a few connections
    rng = np.random.default_rng(0)
    for _ in range(20):
        s, _ = _raw(ps)
        try:
            for _ in range(500):
                s.sendall(rng.bytes(int(rng.integers(1, 200))))
        except OSError:
            pass                                   # the server hung up on us: as it should
        s.close()
    assert ps.connections.rejected >= 3
    assert torch.equal(_still_serving(ps), before) and ps.versions == [0, 0]


def _closed_by_server(s, within: float) -> bool:
    """Whether the server ends the connection ``s`` within ``within`` seconds (what it sent
    before that, e.g. the nonce, is read and dropped)."""
    s.settimeout(within)
    try:
        while s.recv(1 << 16):
            pass
        return True                                # end of stream: closed
    except TimeoutError:
        return False
    except OSError:
        return True                                # reset: closed


@pytest.mark.parametrize("loop", [False, True])
def test_a_peer_that_stalls_before_its_hello_is_let_go(server, loop):
    """A connection gets ``arrivals.seconds`` to say a valid hello, however slowly it sends
    its bytes, and at most ``arrivals.most`` wait for theirs at once (each a thread): a third
    peer is closed at once, the stalled ones when their time is up, and a real worker is
    served after them."""
    ps = server(n=10, optimizer="sgd", lr=1.0, workers=8 if loop else 2, loop=loop)
    ps.connections.arrivals.seconds, ps.connections.arrivals.most = 1.0, 2
    silent, _ = _raw(ps)                           # says nothing
    trickle, _ = _raw(ps)                          # a byte at a time, never a whole frame
    for _ in range(3):
        trickle.sendall(MAGIC[:1])
        time.sleep(0.1)
    third = socket.create_connection(ps.address, timeout=5)
    assert _closed_by_server(third, 1.0)           # two are waiting: not served
    assert _closed_by_server(silent, 3.0) and _closed_by_server(trickle, 3.0)
    for s in (silent, trickle, third):
        s.close()
    assert ps.stats()["turned_away_before_hello"] == 3 and ps.connections.rejected == 0
    assert torch.equal(_still_serving(ps), torch.linspace(-1, 1, 10, dtype=torch.float64))


def test_a_sync_hello_that_waits_for_the_others_is_not_late(server):
    """The time limit is on saying the hello, not on its answer: in sync mode a worker's
    hello waits for every worker, here longer than the limit, and is answered."""
    ps = server(n=10, mode="sync", workers=2)
    ps.connections.arrivals.seconds = 0.5
    first = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    answered = []
    t = threading.Thread(target=lambda: answered.append(first.hello(rows=4, batch_size=2)))
    t.start()
    time.sleep(1.5)                                # three times the limit
    second = PSClient(ps.address, SECRET, 1, dtype=torch.float64)
    assert second.hello(rows=4, batch_size=2) == 2
    t.join(timeout=10)
    assert answered == [2] and ps.stats()["turned_away_before_hello"] == 0
    first.close()
    second.close()


def test_push_of_the_wrong_size_or_nan_is_refused(server):
    ps = server(n=10, optimizer="sgd", lr=1.0)
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    c.hello(rows=1, batch_size=1)
    with pytest.raises(PSError, match="NaN or inf"):
        c.push(torch.full((10,), float("nan"), dtype=torch.float64), samples=1)
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    c.hello(rows=1, batch_size=1)
    c.bounds = [0, 5]                               # lie about the shard size
    with pytest.raises(PSError, match="expected 80"):
        c.push(torch.ones(5, dtype=torch.float64), samples=1)
    with pytest.raises(ValueError, match="the buffer holds 10 values, the shards"):
        c.push(torch.ones(10, dtype=torch.float64), samples=1)   # caught before sending
    assert ps.versions == [0]


def test_bad_server_arguments():
    with pytest.raises(ValueError, match="unknown mode 'eventual'"):
        ParameterServer(torch.zeros(3), SECRET, mode="eventual")
    with pytest.raises(ValueError, match="unknown server optimizer 'lamb'"):
        StepRule(optimizer="lamb")
    with pytest.raises(ValueError, match=r"shards must be in 1..3"):
        ParameterServer(torch.zeros(3), SECRET, shards=4)


def test_bounded_staleness_holds_a_worker_that_runs_ahead(server):
    import time
    ps = server(n=4, optimizer="sgd", lr=1.0, max_staleness=1)
    fast = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    slow = PSClient(ps.address, SECRET, 1, dtype=torch.float64)
    fast.hello(rows=1, batch_size=1)
    slow.hello(rows=1, batch_size=1)
    g = torch.ones(4, dtype=torch.float64)
    fast.push(g, samples=1)                        # 1 ahead of the slow worker: allowed
    t = threading.Thread(target=fast.push, args=(g, 1))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and ps.versions == [1]     # 2 ahead: held back
    slow.push(g, samples=1)
    t.join(timeout=5)
    assert not t.is_alive() and ps.versions == [3] and ps.waits == 1
    slow.close()                                   # a finished worker holds nobody back
    time.sleep(0.1)
    fast.push(g, samples=1)
    fast.push(g, samples=1)
    assert ps.versions == [5]


def test_the_server_averages_its_values_over_a_fraction_of_an_epoch(server):
    """average=0.5 with 4 steps an epoch: after step t, x̄ <- x̄ + (x - x̄) / (0.5 min(4, t)),
    x̄ = x while that span is <= 1 (the first epoch averages the last half of the steps so far,
    not the initial values); parameters() is x̄, the workers' values stay x, and a checkpoint
    brings x̄ back."""
    ps = server(n=4, optimizer="sgd", lr=0.5, average=0.5)
    x = ps.parameters()
    avg = x.clone()
    assert torch.equal(x, ps.parameters(averaged=False))
    g = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    c.hello(rows=4, batch_size=1)                     # 4 steps an epoch: a span of 2 steps
    for k, grad in enumerate(g):
        assert c.push(grad, samples=1, versions=[k]) == [0]
        x = x - 0.5 * grad
        span = 0.5 * min(4, k + 1)
        avg = avg + (x - avg) / span if span > 1 else x
    c.close()
    assert torch.allclose(ps.parameters(averaged=False), x, atol=1e-12)
    assert torch.allclose(ps.parameters(), avg, atol=1e-12)
    state = ps.state_dict()
    fresh = server(n=4, optimizer="sgd", lr=0.5, average=0.5)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.parameters(), ps.parameters())
    assert torch.equal(fresh.parameters(averaged=False), ps.parameters(averaged=False))
    with pytest.raises(ValueError, match="average must be >= 0"):
        server(n=4, average=-1)


def test_the_average_spans_a_fraction_of_an_epoch_whatever_the_push_size(server):
    """Pushes of k = 2 mini-batch steps (a Boosting key, a Downpour push of n_push=2): after
    the push that brings the steps to t, x̄ <- x̄ + k (x - x̄) / (0.5 min(8, t)), x̄ = x while
    that span is <= k; so average=0.5 covers half an epoch's mini-batch steps, not half an
    epoch's pushes (which would be a whole epoch here)."""
    ps = server(n=4, optimizer="sgd", lr=0.5, average=0.5)
    x = ps.parameters()
    avg = x.clone()
    g = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    c = PSClient(ps.address, SECRET, 0, dtype=torch.float64)
    c.hello(rows=8, batch_size=1)                     # 8 steps an epoch: a span of 4 steps
    weights = []
    for k, grad in enumerate(g):
        c.push(2 * grad, samples=2, steps=2, versions=[k])   # 2 steps of mean gradient grad
        x = x - 0.5 * 2 * grad                        # linear push scaling: 2 x the mean
        span = 0.5 * min(8, 2 * (k + 1))
        weights.append(2 / span if span > 2 else 1.0)
        avg = avg + (x - avg) * weights[-1]
    c.close()
    assert weights == [1.0, 1.0, 2 / 3, 0.5]
    assert torch.allclose(ps.parameters(averaged=False), x, atol=1e-12)
    assert torch.allclose(ps.parameters(), avg, atol=1e-12)


def test_data_keys_a_push_counts_only_under_its_lease_and_epochs_keep_their_state(server):
    from spark_dl.strategies.boosting.keys import KeyScheduler
    keys = KeyScheduler(3, epochs=2, workers=2, seed=0, lease_s=0.2)
    ps = server(n=10, mode="sequential", optimizer="sgd", lr=1.0, keys=KeyLeases(keys))
    a, b = (PSClient(ps.address, SECRET, w, torch.float64) for w in (0, 1))
    for c in (a, b):
        c.hello(0, 1)
        c.pull(torch.empty(10, dtype=torch.float64))
    one = torch.ones(10, dtype=torch.float64)
    what, k0, epoch = a.next_key()
    assert what == "key" and epoch == 0
    time.sleep(0.3)                          # a's lease runs out: b takes k0 back first
    assert b.next_key() == ("key", k0, 0)
    a.push(one, 1)                           # a's late push: dropped, nothing applied
    assert ps.versions == [0] and ps.dropped == 1
    b.push(one, 1)
    assert ps.versions == [1]
    for _ in range(2):                       # the epoch's other two keys, by b
        what, _, _ = b.next_key()
        assert what == "key"
        b.push(one, 1)
    state = ps.keys.next_epoch_state(1, 1.0)   # the server as the epoch's last push left it
    assert state["versions"] == [3]
    assert torch.allclose(state["values"][0], torch.linspace(-1, 1, 10, dtype=torch.float64)
                          - 3)
    assert [sorted(k for k, _ in ep) for ep in keys.served] == [[0, 1, 2], []]
    assert a.next_key()[0] == "key"          # epoch 2 has begun
    for c in (a, b):
        c.close()


@pytest.mark.parametrize("pull,loop,n", [(True, False, 10), (False, False, 10),
                                         (True, True, 10), (True, True, 1 << 21)])
def test_a_key_asked_behind_a_push_is_served_after_the_push_is_applied(server, pull, loop, n):
    """push(ask_key=True) sends the key request before it reads the push's reply: the server
    answers it after applying the push, so the worker gets its next key, not its last one
    back (a worker that asks while it holds a lease is a retried task), and "finished" after
    the fit's last key. With 2M values the event loop cannot write the reply at once: it
    reads the request once the reply is out."""
    from spark_dl.strategies.boosting.keys import KeyScheduler
    keys = KeyScheduler(3, epochs=1, workers=1, seed=0)
    ps = server(n=n, mode="sequential", optimizer="sgd", lr=1.0, keys=KeyLeases(keys),
                loop=loop)
    assert (ps.connections.loop is not None) == loop          # the event loop reads frames as they come
    c = PSClient(ps.address, SECRET, 0, torch.float64)
    c.hello(0, 1)
    values = torch.empty(n, dtype=torch.float64)
    c.pull(values)
    got = [c.next_key()]
    while got[-1][0] == "key":
        c.push(torch.ones(n, dtype=torch.float64), 1, pull_into=values if pull else None,
               ask_key=True)
        sent = c.conn.bytes_sent
        got.append(c.next_key())
        assert c.conn.bytes_sent == sent             # the request went out with the push
    assert [w for w, _, _ in got] == ["key"] * 3 + ["finished"]
    assert sorted(k for _, k, _ in got[:3]) == [0, 1, 2] and keys.reissued == 0
    assert ps.versions == [3] and [len(ep) for ep in keys.served] == [3]
    if pull:
        assert torch.equal(values, ps.parameters(averaged=False))
    c.close()


def test_a_request_while_a_key_is_asked_is_refused_before_it_is_sent(server):
    """The key's reply comes before any other: a pull or push before next_key() would read
    it as its own, so the client refuses them, and next_key() then gets the key."""
    from spark_dl.strategies.boosting.keys import KeyScheduler
    ps = server(n=10, mode="sequential", optimizer="sgd", lr=1.0,
                keys=KeyLeases(KeyScheduler(2, epochs=1, workers=1)))
    c = PSClient(ps.address, SECRET, 0, torch.float64)
    c.hello(0, 1)
    values = torch.empty(10, dtype=torch.float64)
    c.pull(values)
    assert c.next_key()[0] == "key"
    c.push(torch.ones(10, dtype=torch.float64), 1, pull_into=values, ask_key=True)
    sent = c.conn.bytes_sent
    with pytest.raises(RuntimeError, match=r"a pull after push\(ask_key=True\): read the "
                                           r"next key with next_key\(\) first"):
        c.pull(values)
    with pytest.raises(RuntimeError, match="a push after push"):
        c.push(torch.ones(10, dtype=torch.float64), 1, ask_key=True)
    assert c.conn.bytes_sent == sent and ps.versions == [1]
    assert c.next_key()[0] == "key"
    c.pull(values)                                       # and then anything again
    c.close()


def test_a_key_request_needs_a_fit_with_keys(server):
    ps = server(n=10)
    c = PSClient(ps.address, SECRET, 0)
    c.hello(10, 1)
    with pytest.raises(PSError, match="data keys"):
        c.next_key()
    with pytest.raises(ValueError, match="sequential"):
        from spark_dl.strategies.boosting.keys import KeyScheduler
        ParameterServer(torch.zeros(10), SECRET, mode="async",
                        keys=KeyLeases(KeyScheduler(2, 1, 1)))


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_a_shards_own_sgd_step_is_torchs_bit_for_bit_and_checkpoints_alike(optimizer):
    """The shard steps SGD itself (no torch.optim wrapper per push): the values after every
    push, scaled and cut, and the momentum buffer its state dict carries are torch's."""
    from spark_dl.transport.ps.shard import Shard
    start = torch.randn(300, generator=torch.Generator().manual_seed(1))
    shard = Shard(start, optimizer, lr=0.05, momentum=0.9, clip=2.0)
    param = torch.nn.Parameter(start.clone())
    ref = torch.optim.SGD([param], lr=0.05, momentum=0.9 if optimizer == "momentum" else 0)
    grads = torch.randn(40, 300, generator=torch.Generator().manual_seed(2))
    grads[30] *= 50                                   # a spike the cut trims
    for g in grads:
        shard.apply(g, scale=0.25, epoch_steps=1000)   # constant rate: no schedule given
        param.grad = shard.param.grad.clone()          # the step's gradient, scaled and cut
        ref.step()
        assert torch.equal(shard.param.detach(), param.detach())
    assert shard.clipped >= 1
    saved = shard.opt.state_dict()
    if optimizer == "momentum":
        assert torch.equal(saved["state"][0]["momentum_buffer"],
                           ref.state_dict()["state"][0]["momentum_buffer"])
    again = Shard(start, optimizer, lr=0.05, momentum=0.9)
    again.param.data.copy_(shard.param.detach())
    again.opt.load_state_dict(saved)
    again.apply(grads[0], epoch_steps=1000)
    ref.zero_grad()
    param.grad = grads[0].clone()
    ref.step()
    assert torch.equal(again.param.detach(), param.detach())


def test_a_workers_carried_momentum_on_a_plain_server_is_torchs_momentum_sgd():
    """Staleness rule "dana": one worker carrying the momentum over its pushes (sums of
    uneven numbers of samples) and a server stepping them without momentum move the values
    as torch's momentum SGD on the mean gradients does."""
    from spark_dl.strategies.ps_worker import carry_momentum
    from spark_dl.transport.ps.shard import Shard
    start = torch.randn(300, generator=torch.Generator().manual_seed(3))
    shard = Shard(start, "momentum", lr=0.05, momentum=0.0)
    param = torch.nn.Parameter(start.clone())
    ref = torch.optim.SGD([param], lr=0.05, momentum=0.9)
    velocity = torch.zeros(300)
    means = torch.randn(40, 300, generator=torch.Generator().manual_seed(4))
    for i, mean in enumerate(means):
        samples = 16 if i % 5 else 7                  # an epoch's short last push
        pushed = mean * samples                       # what backward sums over the samples
        carry_momentum(velocity, pushed, samples, 0.9)
        shard.apply(pushed, scale=1 / samples, epoch_steps=1000)
        param.grad = mean.clone()
        ref.step()
        torch.testing.assert_close(shard.param.detach(), param.detach())
    torch.testing.assert_close(velocity, ref.state_dict()["state"][0]["momentum_buffer"])


def test_a_resumed_server_runs_its_own_momentum_with_the_saved_buffer():
    """A checkpoint saved under one staleness rule (server momentum 0.6) and resumed under
    another: the momentum is the new rule's (0.9: the buffer goes on; 0, as "dana" runs
    it: the buffer is dropped), not the saved 0.6."""
    from spark_dl.transport.ps.shard import Shard
    saved = Shard(torch.zeros(5), "momentum", lr=0.1, momentum=0.6)
    for _ in range(3):
        saved.apply(torch.ones(5), epoch_steps=1000)
    buffer = saved.opt.state[saved.param]["momentum_buffer"].clone()
    assert torch.equal(buffer, torch.full((5,), 1 + 0.6 + 0.36))
    state = saved.opt.state_dict()
    higher = Shard(torch.zeros(5), "momentum", lr=0.1, momentum=0.9)
    higher.load_optimizer(state)
    assert higher.opt.param_groups[0]["momentum"] == 0.9
    assert torch.equal(higher.opt.state[higher.param]["momentum_buffer"], buffer)
    higher.apply(torch.ones(5), epoch_steps=1000)
    assert torch.equal(higher.opt.state[higher.param]["momentum_buffer"], 0.9 * buffer + 1)
    plain = Shard(torch.zeros(5), "momentum", lr=0.1, momentum=0.0)
    plain.load_optimizer(state)
    assert plain.opt.param_groups[0]["momentum"] == 0.0
    assert "momentum_buffer" not in plain.opt.state[plain.param]
    plain.apply(torch.ones(5), epoch_steps=1000)
    torch.testing.assert_close(plain.param.detach(), torch.full((5,), -0.1))


def test_the_servers_schedule_is_fits_times_the_rate():
    from types import SimpleNamespace

    from spark_dl.strategies.ps_rules import lr_schedule
    job = SimpleNamespace(train={"lr": 0.02, "lr_scaling": "linear", "warmup_epochs": "auto",
                                 "lr_decay": 0.5}, stage={"epochs": 3})
    schedule = lr_schedule(job, 16, "async", 0.25)
    assert schedule.at(0.0) == pytest.approx(0.005) and schedule.at(1.0) == pytest.approx(0.0025)


def test_a_workers_momentum_ramps_up_over_its_first_mini_batches():
    """Staleness rule "dana": the momentum a worker carries grows linearly from 0 over its
    first MOMENTUM_RAMP mini-batches (its first push a plain gradient), then stays fit's;
    carried through carry_momentum, the buffer is torch's SGD buffer under that schedule."""
    from spark_dl.strategies.ps_worker import MOMENTUM_RAMP, carry_momentum, ramped
    assert ramped(0.9, 0) == 0.0
    assert ramped(0.9, MOMENTUM_RAMP // 2) == pytest.approx(0.45)
    assert ramped(0.9, MOMENTUM_RAMP) == ramped(0.9, 10 * MOMENTUM_RAMP) == 0.9
    assert ramped(0.0, MOMENTUM_RAMP) == 0.0
    velocity, expected, carried = torch.zeros(4), torch.zeros(4), 0
    for i in range(MOMENTUM_RAMP // 4 + 3):             # pushes of 4 mini-batches of 8 rows
        mean = torch.full((4,), float(i + 1))
        pushed = mean * 32
        m = ramped(0.9, carried)
        carry_momentum(velocity, pushed, 32, m)
        expected = m * expected + mean
        carried += 4
        torch.testing.assert_close(velocity, expected)
        torch.testing.assert_close(pushed, expected * 32)
    assert m == 0.9 and carried > MOMENTUM_RAMP


def test_a_short_fits_ramp_is_a_tenth_of_it():
    """The ramp takes MOMENTUM_RAMP mini-batches, or a tenth of a worker's fit where that is
    shorter (a fit of 24 mini-batches ramps over 2), at least 1; ramped follows its length."""
    from spark_dl.strategies.ps_worker import MOMENTUM_RAMP, ramp_length, ramped
    assert ramp_length(3000) == ramp_length(10 * MOMENTUM_RAMP) == MOMENTUM_RAMP
    assert ramp_length(24) == 2 and ramp_length(5) == ramp_length(0) == 1
    assert ramp_length(123.9) == 12
    assert [ramped(0.9, b, 2) for b in (0, 1, 2, 3)] == [0.0, 0.45, 0.9, 0.9]


@pytest.mark.parametrize("n", [10, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_nan_check_of_small_and_large_pushes(n, dtype):
    """numpy sums small pushes, torch large ones: both refuse NaN and inf anywhere and take
    finite values whose sum overflows, without a warning in the serving threads (which
    quiet numpy's, each for itself)."""
    import warnings

    from spark_dl.transport.ps.payload import is_finite, quiet_numpy
    big = torch.finfo(dtype).max / 2
    got = []

    def serving_thread():
        quiet_numpy()
        with warnings.catch_warnings():
            warnings.simplefilter("error")              # a warning fails the check
            got.append(is_finite(torch.zeros(n, dtype=dtype)))
            got.append(is_finite(torch.full((n,), big, dtype=dtype)))   # the sum is inf
            for bad in (float("nan"), float("inf"), -float("inf")):
                g = torch.zeros(n, dtype=dtype)
                g[n // 2] = bad
                got.append(is_finite(g))
    t = threading.Thread(target=serving_thread)
    t.start()
    t.join()
    assert got == [True, True, False, False, False]


@pytest.mark.parametrize("loop", [False, True])
def test_a_frame_before_the_hello_is_refused_and_one_after_close_changes_nothing(loop):
    """A push without a hello could speak for any worker (and move its step count, which a
    retried task resumes from); a frame that arrives after close() is not applied."""
    from spark_dl.transport.ps.wire import DTYPE_CODES
    ps = ParameterServer(torch.zeros(4), SECRET, workers=8 if loop else 2, loop=loop)
    try:
        c = PSClient(ps.address, SECRET, 0)
        c.conn.send(OPS["push"], torch.ones(4), worker=5, count=1, steps=50,
                    code=DTYPE_CODES[torch.float32])
        with pytest.raises(PSError, match="a push frame before the connection's hello"):
            c._reply(0)
        assert ps.versions == [0] and dict(ps.shards[0].done) == {}
        late = PSClient(ps.address, SECRET, 1)
        late.hello(rows=10, batch_size=1)
        ps.close()
        with pytest.raises((ConnectionError, OSError, PSError)):
            late.push(torch.ones(4), samples=1)
        assert ps.versions == [0] and torch.equal(ps.parameters(), torch.zeros(4))
    finally:
        ps.close()


def test_the_server_accepts_again_after_running_out_of_file_descriptors(tmp_path):
    """Peers that hold sockets without a hello (or a burst of real ones) can exhaust the
    driver's file descriptors: accept() fails with EMFILE, which once ended the accept thread
    for good; now serving goes on once they let go."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import os, resource, socket, time, torch
        from spark_dl.transport.ps import ParameterServer, PSClient
        resource.setrlimit(resource.RLIMIT_NOFILE, (80, 80))
        ps = ParameterServer(torch.zeros(4), {SECRET!r}, workers=8, loop=True)
        held = []
        try:
            for _ in range(100):
                held.append(socket.create_connection(ps.address))
        except OSError:
            pass
        time.sleep(0.5)
        assert ps.connections.thread.is_alive(), "the accept thread ended"
        for s in held:
            s.close()
        time.sleep(0.5)
        c = PSClient(ps.address, {SECRET!r}, 0, timeout_s=5)
        c.hello(rows=1, batch_size=1)
        print("served", len(held), flush=True)
        ps.close()
        os._exit(0)                 # no interpreter teardown after torch (seconds): all said
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("served")


@pytest.mark.parametrize("loop", [False, True])
def test_a_refused_worker_reads_the_reason_not_a_reset(loop):
    """The worker pushes to two shards back to back; the server refuses the first (NaN) while
    the second's 16 MB still come in. Closing at once with them unread reset the connection,
    and the worker saw ConnectionResetError in most runs instead of the reason."""
    n = 8_000_000
    grad = torch.ones(n)
    grad[0] = float("nan")
    for _ in range(5):
        ps = ParameterServer(torch.zeros(n), SECRET, workers=8 if loop else 2, shards=2,
                             loop=loop)
        try:
            c = PSClient(ps.address, SECRET, 0)
            c.hello(rows=10, batch_size=1)
            with pytest.raises(PSError, match="holds NaN or inf; the worker diverged"):
                c.push(grad, samples=1)
        finally:
            ps.close()



@pytest.mark.parametrize("loop", [False, True])
def test_a_worker_beside_the_server_reads_its_version_from_the_board_and_asks_when_moved(
        server, tmp_path, loop):
    """Fresh values with the version board (both serving paths): an unmoved server is
    answered from the mapped file (nothing sent), a moved one over the channel, with the
    values; the file is the driver's user's alone, carries the fit's token, and goes with
    the server."""
    import os

    from spark_dl.transport.ps.board import BoardReader, host_id
    path = tmp_path / "ps-versions"
    path.write_bytes(b"left by an earlier fit")            # replaced, not reused
    ps = server(n=10, mode="sequential", optimizer="sgd", lr=1.0, board=path,
                workers=8 if loop else 2, loop=loop)
    assert os.stat(path).st_mode & 0o777 == 0o600 and path.stat().st_size == 16
    a, b = (PSClient(ps.address, SECRET, w, torch.float64) for w in (0, 1))
    for c in (a, b):
        c.hello(0, 1)
        c.pull(torch.empty(10, dtype=torch.float64))
    assert BoardReader.open((str(path), host_id(), ps.board.token + 1), 1) is None  # not ours
    a.watch(BoardReader.open(ps.board.ticket(), 1))
    assert a.board is not None
    out = torch.full((10,), 7.0, dtype=torch.float64)
    sent = a.conn.bytes_sent
    assert a.pull_newer(out) == [] and a.board_skips == 1
    assert a.conn.bytes_sent == sent and (out == 7.0).all()       # nothing asked, untouched
    b.push(torch.ones(10, dtype=torch.float64), 1)                # the server moves
    assert a.pull_newer(out) == [(0, 10)] and a.board_skips == 1  # asked: the new values
    assert a.conn.bytes_sent > sent
    assert torch.allclose(out, torch.linspace(-1, 1, 10, dtype=torch.float64) - 1)
    assert a.versions == [1] and a.pull_newer(out) == [] and a.board_skips == 2
    for c in (a, b):
        c.close()
    # a resumed server puts its restored versions on the board
    state = ps.state_dict()
    again = server(n=10, mode="sequential", optimizer="sgd", lr=1.0,
                   board=tmp_path / "again")
    again.load_state_dict(state)
    assert BoardReader.open(again.board.ticket(), 1).version(0) == 1
    ps.close()
    assert not path.exists()


def test_a_board_on_another_machine_or_missing_or_cut_short_is_not_read(tmp_path):
    from spark_dl.transport.ps.board import BoardReader, VersionBoard, host_id
    board = VersionBoard(tmp_path / "v", 3)
    board.write(2, 41)
    assert BoardReader.open(board.ticket(), 3).version(2) == 41
    assert BoardReader.open((str(tmp_path / "v"), "another-host/boot", board.token), 3) is None
    assert BoardReader.open(board.ticket(), 4) is None
    assert BoardReader.open((str(tmp_path / "missing"), host_id(), board.token), 3) is None
    assert BoardReader.open(None, 3) is None
    (tmp_path / "short").write_bytes(b"\0" * 12)
    assert BoardReader.open((str(tmp_path / "short"), host_id(), 0), 1) is None
    board.close()
    board.write(2, 42)                      # a push that raced the close: dropped, no error
    assert not (tmp_path / "v").exists()


def test_a_board_that_cannot_be_made_leaves_the_workers_asking(server, tmp_path):
    ps = server(n=10, mode="sequential", board=tmp_path / "no-such-dir" / "ps-versions")
    assert ps.board is None                  # the fit goes on; its workers ask the server
    c = PSClient(ps.address, SECRET, 0, torch.float64)
    c.hello(0, 1)
    c.pull(torch.empty(10, dtype=torch.float64))
    sent = c.conn.bytes_sent
    assert c.pull_newer(torch.empty(10, dtype=torch.float64)) == []
    assert c.board is None and c.board_skips == 0 and c.conn.bytes_sent > sent
    c.close()


@pytest.mark.parametrize("loop", [False, True])
def test_dana_workers_fetch_the_look_ahead_of_every_workers_momentum_step(server, loop):
    """Staleness rule "dana": a worker fetches x - lr S, S the sum over the workers of the
    momentum each reported times its last step gradient, which its next push steps again;
    a worker whose connection closed is out of S, and a retried task (a new connection of
    the same worker id) starts with nothing in it, while the attempt before it stays until
    its connection closes. The server's own values and its average are the plain x."""
    ps = server(n=10, shards=1 if loop else 2, optimizer="sgd", lr=0.5, ahead=True,
                loop=loop, average=0.1)
    assert ps.stats()["serving"] == ("loop" if loop else "threads")
    f64 = dict(dtype=torch.float64)
    a, b = PSClient(ps.address, SECRET, 0, **f64), PSClient(ps.address, SECRET, 1, **f64)
    a.hello(rows=4, batch_size=2)
    b.hello(rows=4, batch_size=2)
    out = torch.empty(10, **f64)
    a.pull(out)
    assert torch.equal(out, ps.parameters(averaged=False))           # nothing to come yet
    ga, gb = torch.arange(10, **f64), torch.ones(10, **f64) * 3
    a.push(ga * 2, samples=2, momentum=0.45)                           # sums of 2 samples
    b.push(gb * 4, samples=4, momentum=0.9)
    a.push(ga * 4, samples=2, pull_into=out, momentum=0.9)             # ga again, 2x
    x = ps.parameters(averaged=False)
    torch.testing.assert_close(x, torch.linspace(-1, 1, 10, **f64) - 0.5 * (ga + gb + 2 * ga))
    torch.testing.assert_close(out, x - 0.5 * 0.9 * (2 * ga + gb))
    shards = 1 if loop else 2                # hello, pull, 0.45 and 0.9, 2 pushes
    assert a.conn.send_seq == 1 + shards + 2 + 2 * shards

    def fetched_soon(client, expected) -> bool:     # a bye is read by the server's thread
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            client.pull(out)
            if torch.allclose(out, expected):
                return True
            time.sleep(0.01)
        return False
    b.close()                                                          # b pushes no more
    assert fetched_soon(a, x - 0.5 * 0.9 * 2 * ga)
    again = PSClient(ps.address, SECRET, 0, **f64)                     # a, retried
    again.hello(rows=4, batch_size=2)
    again.push(ga * 0, samples=2, momentum=0.9)          # its first push: a zero step
    again.pull(out)
    torch.testing.assert_close(out, x - 0.5 * 0.9 * 2 * ga)           # a's term still in
    a.conn.sock.close()                                  # a dies without a bye
    assert fetched_soon(again, x)
    assert torch.equal(ps.parameters(averaged=False), x)
    again.close()


def test_the_look_ahead_sums_its_terms_anew_and_refuses_what_it_cannot_use(server):
    from spark_dl.transport.ps.shard import Ahead
    ahead = Ahead(torch.zeros(50, dtype=torch.float32))
    gen = torch.Generator().manual_seed(0)
    for k in range(Ahead.RESUM):
        ahead.record(k % 3, torch.randn(50, generator=gen) * 1e3, 0.01 * 0.9)
        if k == 10:                             # kept by updates: off by their rounding
            drifted = torch.zeros(50)
            for term in ahead.terms.values():
                drifted.add_(term)
            assert not torch.equal(ahead.sum, drifted)
    exact = torch.zeros(50)                     # the RESUM-th update sums them anew
    for term in ahead.terms.values():
        exact.add_(term)
    assert torch.equal(ahead.sum, exact)
    ahead.forget(1)
    exact = ahead.terms[0] + ahead.terms[2]
    assert torch.equal(ahead.sum, exact) and set(ahead.terms) == {0, 2}
    with pytest.raises(ValueError, match=r"ahead .* needs pushes stepped one by one"):
        server(n=10, mode="sync", ahead=True)
    for optimizer, momentum in (("adam", 0.9), ("momentum", 0.9)):
        with pytest.raises(ValueError, match=r"needs a server stepping plain SGD"):
            server(n=10, optimizer=optimizer, momentum=momentum, ahead=True)
    f64 = dict(dtype=torch.float64)
    for ahead, payload, error in (
            (False, torch.tensor([0.9], **f64), "needs a server with look-ahead"),
            (True, torch.tensor([1.0], **f64), r"must be in \[0, 1\), got 1.0"),
            (True, torch.tensor([float("nan")], **f64), r"must be in \[0, 1\), got nan"),
            (True, torch.tensor([0.9]), r"one float64 .* got dtype code 0 and 4 bytes"),
            (True, torch.tensor([0.9, 0.9], **f64), r"got dtype code 1 and 16 bytes")):
        ps = server(n=10, ahead=ahead, optimizer="sgd")
        c = PSClient(ps.address, SECRET, 0, **f64)
        c.hello(rows=4, batch_size=2)
        c.conn.send(OPS["momentum"], payload, worker=0)
        with pytest.raises(PSError, match=error):
            c.pull(torch.empty(10, **f64))
        c.close()


def test_the_dana_rule_keeps_fits_momentum_at_the_workers_at_a_rate_from_1_to_a_half():
    """Staleness rule "dana": fit's momentum at the workers, none on the server; the server's
    rate 1 up to 4 replicas, 4 / R from there, not below 1/2 (overlapped pushes: that of
    twice the replicas)."""
    from spark_dl.strategies.ps_rules import (
        dana_rate,
        server_momentum,
        worker_momentum,
        worker_rule,
    )
    assert [dana_rate(r) for r in (1, 2, 4, 5, 8, 16, 64)] == [1, 1, 1, 0.8, 0.5, 0.5, 0.5]
    assert worker_rule(0.9, 2, False, "dana") == (0.9, 1.0)
    assert worker_rule(0.9, 4, True, "dana") == (0.9, 0.5)
    assert worker_rule(0.0, 4, False, "dana") == (0.0, 1.0)          # nothing moved
    assert worker_momentum(0.9, 2, "async", "dana", "momentum") == 0.9
    assert worker_momentum(0.9, 1, "async", "dana", "momentum") == 0.0
    assert worker_momentum(0.9, 2, "async", "dana", "adam") == 0.0
    assert server_momentum(0.9, 2, "async", "dana") == 0.0
