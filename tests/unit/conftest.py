"""Fixtures of the unit tests: ``ps_servers`` makes parameter servers over real sockets
(test_ps.py, test_ps_loop.py) with the secret SECRET on linspace(-1, 1, n) values, closed
when the test ends (the keywords of a StepRule make its rule, the others go to the server);
``in_threads`` runs their clients at once."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from spark_dl.transport.ps import ParameterServer, StepRule

SECRET = b"s" * 32


@pytest.fixture
def ps_servers():
    servers = []

    def make(n=1000, **kw):
        rule = {f.name: kw.pop(f.name) for f in dataclasses.fields(StepRule) if f.name in kw}
        ps = ParameterServer(torch.linspace(-1, 1, n, dtype=torch.float64), SECRET,
                             rule=StepRule(**rule), **kw)
        servers.append(ps)
        return ps
    yield make
    for ps in servers:
        ps.close()


def in_threads(target, n: int) -> list[Exception]:
    """``target(w)`` for w in range(n), each in a thread of its own, all at once; returns what
    they raised (the test asserts it is nothing)."""
    errors: list[Exception] = []

    def run(w):
        try:
            target(w)
        except Exception as e:                      # pragma: no cover - reported by the test
            errors.append(e)
    threads = [threading.Thread(target=run, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
