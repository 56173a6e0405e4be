"""RD-PSGD's task half: every replica trains its own model on its shard and, every
``sync_every`` steps, averages the coordinates of one shared Bernoulli(α) mask with its ring
neighbours (rounds.py) between computing its gradient and taking its step.

A replica's parameters live in one flat buffer (each parameter a view of it), so a round is
one index_select, the point-to-point exchange and one index_copy_. After every epoch the
replicas agree on their average (one all-reduce), measure how far they are from it (the
consensus distance, mean ‖x_i − x̄‖²); the replica loop (spark_dl.runtime.loop) validates,
checkpoints and returns the replicas' average, as for every strategy whose replicas differ.
"""

from __future__ import annotations

import time

import torch

from spark_dl.runtime.loop import FitParts, Hooks, ReplicaLoop, replica_task
from spark_dl.runtime.stage import LocalStepConfig, shared_memory_name

from .rounds import Rounds, average_and_distance

__all__ = ["GossipHooks", "make_task"]


def make_task(cfg: LocalStepConfig, options, parts: FitParts, secret: str,
              channel: tuple[str, int] | None):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA, barrier=True)`` runs on every task;
    ``options``: the ``Gossip`` with its resolved ``average``."""
    return replica_task(cfg, options, GossipHooks, parts, secret, channel)


class GossipHooks(Hooks):
    """Gossip's part of the replica loop: a gossip round between each replica's gradient and
    its own step, every ``sync_every`` steps."""

    name = "gossip"
    agree = False

    def build(self, loop: ReplicaLoop) -> None:
        cfg, opts = self.cfg, self.options
        self.flat = flat = loop.flat      # the replica's parameters, one buffer
        self.shm, name = None, shared_memory_name(loop.statuses, loop.rank, loop.world,
                                                  loop.device)
        if name is not None:              # one host: the rounds go through shared memory
            from spark_dl.transport.shm import ShmAllReduce
            self.shm = ShmAllReduce(flat.numel(), flat.dtype, name, cfg.timeout_s)
        self.rounds = Rounds(flat, opts.alpha, cfg.seed, loop.rank, loop.world, shm=self.shm,
                             topology=opts.topology)
        self.round_s, self.k = 0.0, 0

    def restore(self, loop: ReplicaLoop, state: dict) -> None:
        self.rounds.bytes_sent, self.rounds.rounds = state["bytes_sent"], state["rounds"]

    def step(self, loop: ReplicaLoop, micro: list, totals: torch.Tensor) -> None:
        opt, precision, k = loop.opt, loop.precision, loop.step_index
        opt.zero_grad()
        for x, y in micro:                           # g_i at x_k,i
            loss = loop.forward_loss(x, y)
            precision.scale_loss(loss).backward()
            totals[0] += loss.detach().to(torch.float64) * len(x)
            totals[1] += len(x)
        every = self.options.sync_every
        if (k + 1) % every == 0:                     # x_k+1/2: the masked average
            t_round = time.perf_counter()
            with torch.no_grad():
                self.rounds.round(k // every)
            self.round_s += time.perf_counter() - t_round
        grads = [p.grad for p in loop.model.parameters() if p.grad is not None]
        if micro and precision.unscale(grads):       # (skipped when fp16 overflowed)
            if loop.clip.on:                         # each replica cuts its own gradient
                loop.clip(grads)
            opt.step()                               # x_k+1 = x_k+1/2 - lr g_i(x_k,i)

    def row(self, loop: ReplicaLoop) -> dict:
        """The bytes each replica sent and the consensus distance (two collectives)."""
        sent = torch.tensor([float(self.rounds.bytes_sent)], dtype=torch.float64,
                            device=loop.device)
        torch.distributed.all_reduce(sent)
        return {"bytes_sent_per_replica": float(sent) / loop.world,
                "consensus_distance": average_and_distance(self.flat)[1]}

    def state(self, loop: ReplicaLoop) -> dict:
        return {"bytes_sent": self.rounds.bytes_sent, "rounds": self.rounds.rounds}

    def info(self, loop: ReplicaLoop) -> dict:
        """(The last consensus distance before the average is taken; a collective.)"""
        import torch.distributed as dist

        from spark_dl.runtime.buffers import collective_device
        opts, rounds, flat = self.options, self.rounds, self.flat
        where = collective_device(loop.device)
        sent = [torch.zeros(1, dtype=torch.float64, device=where) for _ in range(loop.world)]
        dist.all_gather(sent, torch.tensor([float(rounds.bytes_sent)], dtype=torch.float64,
                                           device=where))
        numel, item = flat.numel(), flat.element_size()
        return {"alpha": opts.alpha, "sync_every": opts.sync_every, "rounds": rounds.rounds,
                "topology": opts.topology, "transport": rounds.transport,
                "neighbours": rounds.neighbours, "parameters": numel,
                "bytes_sent": [int(s) for s in sent],
                "bytes_per_round_expected": opts.alpha * numel * item * rounds.neighbours,
                "final_consensus_distance": self.distance,
                "timings": {"gossip_s": self.round_s}}

    def finish(self, loop: ReplicaLoop) -> None:
        self.distance = average_and_distance(self.flat)[1]

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
