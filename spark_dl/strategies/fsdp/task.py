"""FSDP's task half: the replica loop's hooks. Every unit of the model (units.py) and then the
root are sharded with ``torch.distributed.fsdp.fully_shard`` over the replicas (FSDP2): each
replica keeps 1/R of every parameter, its gradient and its optimizer state, and gathers a
unit's parameters only while the unit runs. A step:

    forward (each unit all-gathers its parameters), backward of  n_i · loss_i  (each unit's
    gradients reduce-scattered as a sum), one all-reduce of (loss sum, rows) → N,
    every shard's gradient ÷ N (the sample-weighted mean gradient, AllReduce's), the cut by
    the global norm, the optimizer's step on the shards.

A replica whose shard is used up still runs each unit's collectives: a forward and backward of
zero times the loss, in eval mode (no running statistics change), on a row it kept. The
checkpoint after every epoch is each replica's own shards through torch.distributed.checkpoint
(``run_dir/checkpoint-fsdp/epoch-<e>/``, which reshards on load: a fit may resume on another
number of replicas); the model returned is gathered once, on replica 0, which writes it into
the run directory for the driver (or, where it does not reach the driver's, returns its bytes).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from spark_dl.data.memory import proc_status_kib
from spark_dl.errors import ConfigError, DataError, ResourceError
from spark_dl.runtime.buffers import collective_device
from spark_dl.runtime.loop import FitParts, Hooks, ReplicaLoop, replica_task
from spark_dl.runtime.stage import LocalStepConfig, peak_memory_mb
from spark_dl.transport.rendezvous import task_devices

from .units import wrap_units

__all__ = ["CHECKPOINTS", "FSDPHooks", "check_devices", "make_task"]

CHECKPOINTS = "checkpoint-fsdp"      # the run directory's folder of sharded checkpoints


def make_task(cfg: LocalStepConfig, options, parts: FitParts, secret: str,
              channel: tuple[str, int] | None):
    """The function ``df.mapInArrow(task, RESULT_SCHEMA, barrier=True)`` runs on every task;
    ``options``: the ``FSDP``."""
    return replica_task(cfg, options, FSDPHooks, parts, secret, channel)


def check_devices(statuses: list[dict]) -> None:
    """FSDP's replicas hold their shards on devices of their own: all on the CPU, or each on
    a GPU no other replica of its machine uses (NCCL takes one rank per GPU, and shards that
    share a GPU save it no memory). A ResourceError, the same on every replica, otherwise."""
    groups = task_devices(statuses)
    cpu = sorted(r for (_, device), ranks in groups.items() if not device.startswith("cuda")
                 for r in ranks)
    if len(cpu) == len(statuses):
        return
    if cpu:
        raise ResourceError(
            f"FSDP: replica(s) {cpu} run on the CPU and the others on GPUs, but one model's "
            f"shards live on one kind of device: give every task a GPU "
            f"(spark.task.resource.gpu.amount=1 on GPU executors), or pass device='cpu'")
    for (_, device), ranks in groups.items():
        if len(ranks) > 1:
            raise ResourceError(
                f"FSDP: replicas {ranks} share {device} on one machine; their shards would all "
                f"sit on that GPU (no memory saved) and NCCL takes one rank per GPU: give each "
                f"replica a GPU of its own (spark.task.resource.gpu.amount=1, no more replicas "
                f"than GPUs), or train with AllReduce, whose replicas may share a GPU")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this replica (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


class FSDPHooks(Hooks):
    """FSDP's part of the replica loop (the module doc)."""

    name = "fsdp"
    agree = True
    sharded = True
    totals_global = True

    def __init__(self, cfg: LocalStepConfig, options):
        super().__init__(cfg, options)
        self.amp = None                   # bf16 is FSDP's own policy, not the loop's autocast
        self.blank = None
        self.idle_steps = 0
        self.checkpoint_s = 0.0
        self.model_file = None            # where replica 0 wrote the model (full_state)
        # the worker before the model (its shard read, the group up): memory.py's MARGIN
        self.start = [(proc_status_kib(f) or -1024) / 1024 for f in ("VmRSS", "VmSize")]

    # -- sharding --------------------------------------------------------------------------
    def wrap(self, loop: ReplicaLoop) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        empty = [r for r, s in enumerate(loop.statuses) if not s["rows"]]
        if empty:                         # (the same on every rank: no one waits)
            raise DataError(f"FSDP: partition(s) {empty} hold no rows, but every replica runs "
                            f"each layer's collectives on rows of its own: give the DataFrame "
                            f"partitions that all hold rows (df.repartition(n))")
        check_devices(loop.statuses)
        opts = self.options
        self.units = wrap_units(loop.model, opts.wrap)
        if loop.device.type == "cuda":
            torch.cuda.set_device(loop.device)
        mesh = init_device_mesh(loop.device.type, (loop.world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      output_dtype=torch.float32) \
            if opts.amp == "bf16" else MixedPrecisionPolicy()
        modules = dict(loop.model.named_modules())
        for name in [*self.units, ""]:                      # the root last
            fully_shard(modules[name], mesh=mesh, mp_policy=policy,
                        reshard_after_forward=opts.reshard_after_forward)
        for m in loop.model.modules():    # sums, divided by the global rows in step()
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        self.params = [p for p in loop.model.parameters() if p.requires_grad]
        self.where = collective_device(loop.device)

    # -- a step ----------------------------------------------------------------------------
    def step(self, loop: ReplicaLoop, micro: list, totals: torch.Tensor) -> None:
        loop.opt.zero_grad(set_to_none=True)
        local = torch.zeros(2, dtype=torch.float64, device=self.where)
        if micro:
            x, y = micro[0]
            if self.blank is None:
                self.blank = (x[:1].clone(), y[:1].clone())
            loss = loop.forward_loss(x, y)
            (loss * len(x)).backward()
            local[0] = loss.detach().to(torch.float64) * len(x)
            local[1] = len(x)
        else:                             # this shard is used up: the collectives only
            loop.model.eval()
            (loop.forward_loss(*self.blank) * 0.0).backward()
            loop.model.train()
            self.idle_steps += 1
        dist.all_reduce(local)            # (global loss sum, rows)
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        with torch.no_grad():
            torch._foreach_div_(grads, float(local[1].clamp(min=1.0)))
            if loop.clip.on:
                loop.clip(grads, norm=self._norm(grads))
        loop.opt.step()
        totals += local.to(totals.device)

    def _norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global gradient's norm from the shards (one all-reduce)."""
        squares = torch.stack([g.double().pow(2).sum() for g in grads]).sum() \
            if grads else torch.zeros((), dtype=torch.float64, device=self.where)
        squares = squares.to(self.where)
        dist.all_reduce(squares)
        return squares.sqrt()

    # -- checkpoints -----------------------------------------------------------------------
    def _folder(self, loop: ReplicaLoop) -> Path:
        return Path(loop.parts.run_dir) / CHECKPOINTS

    def state(self, loop: ReplicaLoop) -> dict:
        """Every replica writes its shards of the model and the optimizer (a collective);
        checkpoint.pt names the folder."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        t0 = time.perf_counter()
        epoch = len(loop.history)
        folder = self._folder(loop)
        target = folder / f"epoch-{epoch}"
        if loop.rank == 0:
            shutil.rmtree(target, ignore_errors=True)     # a fit started over in this run_dir
            self._prune(folder, epoch - 2)                # (checkpoint.prev.pt's is epoch - 2)
        dist.barrier()
        model, optim = get_state_dict(loop.model, loop.opt)
        if loop.world > 1:                # the buffers (not sharded) are replica 0's, as
            for name, _ in loop.model.named_buffers():      # AllReduce's checkpoint holds
                if name in model:                           # (each replica keeps its own
                    model[name] = model[name].clone()       # BatchNorm counts)
                    dist.broadcast(model[name], 0)
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(target))
        self.checkpoint_s += time.perf_counter() - t0
        return {"shards": target.name, "idle_steps": self.idle_steps}

    def _prune(self, folder: Path, keep_from: int) -> None:
        for old in folder.glob("epoch-*") if folder.exists() else ():
            suffix = old.name.rpartition("-")[2]
            if suffix.isdigit() and int(suffix) < keep_from:
                shutil.rmtree(old, ignore_errors=True)

    def restore(self, loop: ReplicaLoop, state: dict) -> None:
        """This replica's shards from the checkpoint's folder, resharded to this fit's
        replicas; the hyperparameters stay this fit's (load_optimizer_state's rule)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        source = self._folder(loop) / state["shards"]
        if not (source / ".metadata").exists():
            raise ConfigError(f"the checkpoint names the shards {source}, which are not there "
                              f"(every replica must reach the run directory): start over with "
                              f"resume=False, or give a new run_dir")
        own = [{k: v for k, v in g.items() if k not in ("params", "lr")}
               for g in loop.opt.param_groups]
        model, optim = get_state_dict(loop.model, loop.opt)
        held = {"model": model, "optim": optim}
        dcp.load(held, checkpoint_id=str(source))
        set_state_dict(loop.model, loop.opt, model_state_dict=held["model"],
                       optim_state_dict=held["optim"])
        for group, mine in zip(loop.opt.param_groups, own):
            group.update(mine)
        self.idle_steps = state.get("idle_steps", 0)

    def finish(self, loop: ReplicaLoop) -> None:
        if loop.rank == 0:                # the last checkpoint's shards and the one before
            self._prune(self._folder(loop), len(loop.history) - 1)
        self.held = self._held(loop)

    def _held(self, loop: ReplicaLoop) -> tuple[int, int, int]:
        """Bytes of this replica's shards: parameters, gradients, optimizer state."""
        params = sum(_local(p).numel() * p.element_size() for p in self.params)
        grads = sum(_local(p.grad).numel() * p.grad.element_size() for p in self.params
                    if p.grad is not None)
        optim = sum(_local(v).numel() * v.element_size() for s in loop.opt.state.values()
                    for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return params, grads, optim

    # -- the result ------------------------------------------------------------------------
    def full_state(self, loop: ReplicaLoop, model) -> dict | None:
        """The whole model, gathered once onto replica 0's CPU ({} elsewhere); the gradients
        and the optimizer's state are freed first (the fit is over). Where replica 0 sees the
        driver's run directory (``model_path`` is set), it writes the model there as
        model.pt, which the driver loads, and returns None: the model crosses no JVM, and
        the worker holds it once, not also as bytes."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )
        loop.opt.zero_grad(set_to_none=True)
        loop.opt.state.clear()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        if loop.rank != 0 or self.model_path is None:
            return full
        target = self.model_path
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        torch.save(full, tmp)             # (written record by record: no copy in memory)
        os.replace(tmp, target)
        self.model_file = {"name": target.name, "bytes": target.stat().st_size}
        return None

    def info(self, loop: ReplicaLoop) -> dict:
        """What each replica holds, its worker's memory before the model and its measured
        peak (one all-gather)."""
        held, grads, optim = self.held               # (at the end of training)
        peak = peak_memory_mb()
        gpu = torch.cuda.max_memory_allocated(loop.device) / 2**20 \
            if loop.device.type == "cuda" else -1.0
        mine = torch.tensor([*self.start, peak["peak_rss_mb"], peak.get("peak_vm_mb", -1.0),
                             gpu, held / 2**20, grads / 2**20, optim / 2**20, self.idle_steps],
                            dtype=torch.float64, device=self.where)
        every = [torch.zeros_like(mine) for _ in range(loop.world)]
        dist.all_gather(every, mine)
        keys = ("start_rss_mb", "start_vm_mb", "peak_rss_mb", "peak_vm_mb", "peak_gpu_mb",
                "parameters_mb", "gradients_mb", "optimizer_mb", "idle_steps")
        memory = [{k: int(v) if k == "idle_steps" else v for k, v in zip(keys, row.tolist())
                   if v >= 0} for row in every]
        full = sum(p.numel() * p.element_size() for p in self.params)   # (DTensors: whole)
        return {"units": self.units, "reshard_after_forward": self.options.reshard_after_forward,
                "amp": self.options.amp, "model_parameters_mb": full / 2**20,
                "model_file": self.model_file,
                "memory_per_replica": memory,
                "timings": {"checkpoint_s": self.checkpoint_s}}
