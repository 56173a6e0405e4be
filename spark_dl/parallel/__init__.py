"""Distributed engines: synchronous all-reduce (``allreduce``); more to come."""
