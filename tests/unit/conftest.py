"""Fixtures of the unit tests: ``ps_servers`` makes parameter servers over real sockets
(test_ps.py, test_ps_loop.py) with the secret SECRET on linspace(-1, 1, n) values, closed
when the test ends."""

from __future__ import annotations

import pytest
import torch

from spark_dl.transport.ps import ParameterServer

SECRET = b"s" * 32


@pytest.fixture
def ps_servers():
    servers = []

    def make(n=1000, **kw):
        ps = ParameterServer(torch.linspace(-1, 1, n, dtype=torch.float64), SECRET, **kw)
        servers.append(ps)
        return ps
    yield make
    for ps in servers:
        ps.close()
