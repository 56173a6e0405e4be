"""Communication cost of model parallelism (thesis §3.3) and a planner for F and R.

    T_comm = K [T_lat + N T_data]                                            (eq. 3.4)

K messages per epoch, N data units per message on average (so K N is the epoch's data),
T_lat the latency of one message, T_data the time of one unit (here: one byte).

``thesis_published`` evaluates the thesis's eqs. 3.5-3.9 as printed, for M examples.
``master_counts`` gives the exact messages and bytes of one step of the implementation
(model_parallel/master.py, which documents where and why it departs from the printed
counts); ``collective_counts`` those of the all-gather / all-reduce layers
(model_parallel/layers.py) for a chain of Linear layers. ``step_cost`` prices a step of any
model that ``partition_model`` splits by running it once, in one process, on the meta device:
the partitioned layers talk to a ``CountingComm`` (exact messages and bytes of every rank),
``FlopCounterMode`` counts the flops, autograd's saved-tensor hooks the activations;
``fc_step_cost`` gives the same by formula for an FC net. ``probe`` measures T_lat and T_data
on the running process group, ``probe_flops`` a task's matmul rate; ``plan`` recommends F
(partitions per model) and R (replicas) for a model and a cluster, and explains the
prediction: compute, the layers' collectives, each replica's parameter-server traffic, and a
task's memory (its slice of the parameters, gradients and optimizer state plus the
activations a step keeps for backward, seed 002 §3.2: every layer's output feature maps,
held from the forward pass until the gradients are computed).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time

from ..model_parallel.comm import Comm, split_sizes

__all__ = ["Cluster", "Link", "Plan", "StepCost", "activation_bytes", "collective_counts",
           "fc_step_cost", "flat_input_shape", "master_counts", "plan", "predict_seconds",
           "probe", "probe_flops", "saved_activation_bytes", "step_cost", "thesis_published"]


def thesis_published(sizes: list[int], F: int, M: int, unit: int = 1) -> dict:
    """K and N1..N3, N of eqs. 3.5-3.9 for layer widths ``sizes`` (b_0 .. b_{n-1}), F
    processes and M examples; S(x) = x * unit (unit: bytes per number, or 1 for numbers)."""
    n, lg = len(sizes), math.log2(F) if F > 1 else 0.0
    hidden = range(1, n - 1)
    K = M * ((F - 1) + sum(F * lg + 2 * (F - 1) for _ in hidden))
    N1 = (F - 1) * (sizes[0] + sizes[-1] / F) * unit
    N2 = sum(F * lg * sizes[i] / F for i in hidden) * unit
    N3 = sum((F - 1) * sizes[i + 1] + (F - 1) * sizes[i] / F for i in hidden) * unit
    return {"K": K, "N1": N1, "N2": N2, "N3": N3,
            "N": M * (N1 + N2 + N3) / K if K else 0.0,
            "data": M * (N1 + N2 + N3)}


def master_counts(sizes: list[int], F: int, batch: int, itemsize: int = 4) -> dict:
    """Messages and bytes of one step of MasterBackpropFC (all ranks together), by phase."""
    n = len(sizes)
    B, s = batch, itemsize
    out = split_sizes(sizes[-1], F)
    pow2 = F & (F - 1) == 0
    lg = int(math.log2(F)) if F > 1 else 0
    phases = {
        "init": (F - 1, (F - 1) * B * sizes[0] * s + sum(out[1:]) * B * s),
        "forward": (sum((F * lg if pow2 else F * (F - 1)) for _ in range(1, n - 1)),
                    sum((F - 1) * B * sizes[i] * s for i in range(1, n - 1))),
        "softmax": (2 * (F - 1), (F - 1) * 3 * B * s + (F - 1) * B * s),
        "backward": (sum(2 * (F - 1) for _ in range(1, n - 1)),
                     sum((F - 1) * B * sizes[i] * s + sum(split_sizes(sizes[i], F)[1:]) * B * s
                         for i in range(1, n - 1))),
    }
    if F == 1:
        phases = dict.fromkeys(phases, (0, 0))
    return {"phases": phases, "messages": sum(m for m, _ in phases.values()),
            "bytes": sum(b for _, b in phases.values())}


def collective_counts(sizes: list[int], F: int, batch: int, itemsize: int = 4) -> dict:
    """Messages and bytes of one step of a chain of ColumnLinear layers (all ranks): per
    layer a ring all-gather of its output and, in backward, a ring all-reduce of dE/d(input)
    except for the first layer (its input needs no gradient)."""
    if F == 1:
        return {"messages": 0, "bytes": 0, "all_gathers": 0, "all_reduces": 0}
    B, s = batch, itemsize
    layers = len(sizes) - 1
    msgs = layers * F * (F - 1) + (layers - 1) * 2 * F * (F - 1)
    data = sum((F - 1) * B * sizes[i] * s for i in range(1, layers + 1)) + \
        sum(2 * (F - 1) * B * sizes[i] * s for i in range(1, layers))
    return {"messages": msgs, "bytes": data, "all_gathers": layers, "all_reduces": layers - 1}


@dataclasses.dataclass(frozen=True)
class Link:
    """A measured link: seconds per message and per byte (T_lat, T_data of eq. 3.4)."""
    t_lat: float
    t_data: float


def predict_seconds(counts: dict, link: Link, critical_fraction: float = 1.0) -> float:
    """T_comm = K T_lat + (K N) T_data for the counted messages and bytes. Messages of
    different ranks overlap; ``critical_fraction`` is the share on the critical path (1: all
    serialised, as eq. 3.4 assumes)."""
    return critical_fraction * (counts["messages"] * link.t_lat + counts["bytes"] * link.t_data)


def probe(comm: Comm, small: int = 8, large: int = 1 << 22, repeats: int = 20) -> Link:
    """T_lat and T_data between group ranks 0 and 1 by ping-pong of ``small`` and ``large``
    bytes (one-way = half the round trip). Collective: every rank calls it; ranks other than
    0 and 1 wait. Needs a group of two or more."""
    import torch
    if comm.size < 2:
        raise ValueError("probe needs at least two ranks")

    def one_way(nbytes: int) -> float:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if comm.rank == 0:
                comm.send(buf, 1, "probe")
                comm.recv(buf, 1)
            elif comm.rank == 1:
                comm.recv(buf, 0)
                comm.send(buf, 0, "probe")
            times.append((time.perf_counter() - t0) / 2)
        return sorted(times)[len(times) // 2]

    one_way(small)                                           # warm-up
    t_small, t_large = one_way(small), one_way(large)
    t_data = max(t_large - t_small, 0.0) / (large - small)
    link = torch.tensor([t_small, t_data], dtype=torch.float64)
    comm.broadcast(link, 0, "probe")                         # everyone gets rank 0's view
    return Link(float(link[0]), float(link[1]))


def probe_flops(n: int = 512, batch: int = 256, repeats: int = 5) -> float:
    """This process's dense matmul rate in flop/s (the median of ``repeats`` products of a
    (batch, n) by an (n, n) float32 matrix, with torch's current thread count)."""
    import torch
    a, w = torch.randn(batch, n), torch.randn(n, n)
    a @ w                                                      # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ w
        times.append(time.perf_counter() - t0)
    return 2 * batch * n * n / max(sorted(times)[len(times) // 2], 1e-9)


def activation_bytes(sizes: list[int], F: int, batch: int, itemsize: int = 4) -> int:
    """What one step of a column-partitioned FC net keeps for backward on a task (seed 002
    §3.2's per-layer estimate: each layer's output, held from forward until its gradient is
    computed): the replicated input and gathered outputs of every layer, plus this task's
    slices before the activation, and their gradients while backward runs."""
    gathered = sum(sizes)                                   # a^0 .. a^n, replicated
    slices = sum(-(-b // F) for b in sizes[1:])             # z_p of every layer
    return batch * itemsize * (2 * gathered + slices)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One training step of a model split over F tasks, on one batch: what the busiest task
    (rank 0: it holds the remainder columns and trains the kept-whole layers) computes and
    holds, and what the group sends (all ranks, as ``collective_counts``)."""
    partitions: int
    flops: float                       # forward + backward of the busiest task
    messages: int                      # the group's, per step
    bytes: int
    parameters: int | float            # numbers the busiest task holds (P / F by formula)
    activation_bytes: int              # what a task keeps for backward
    model_parameters: int              # the whole model's P (what a replica pushes, fetches)


def fc_step_cost(sizes: list[int], F: int, batch: int, itemsize: int = 4) -> StepCost:
    """The step of an FC net of widths ``sizes`` by formula: 6 B P / F flops (forward 2 B P,
    backward 4 B P), ``collective_counts``, P / F parameters, ``activation_bytes``."""
    params = sum(a * b + b for a, b in itertools.pairwise(sizes))
    counts = collective_counts(sizes, F, batch, itemsize)
    return StepCost(F, 6 * batch * params / F, counts["messages"], counts["bytes"], params / F,
                    activation_bytes(sizes, F, batch, itemsize), params)


def step_cost(model_fn, input_shape: tuple, F: int, batch: int, dtype=None,
              input_dtype=None) -> StepCost:
    """Run one step of ``model_fn()`` partitioned F ways, as rank 0, on a batch of ``batch``
    inputs of shape ``input_shape`` (one sample's; ``input_dtype``, default ``dtype``, e.g.
    torch.long for token ids), on the meta device (no memory, no arithmetic):

    messages, bytes   counted by a CountingComm: exactly what the F ranks' Comms count
    flops             FlopCounterMode (matmuls and convolutions) of rank 0's forward and
                      backward: the whole model's / F when the columns split evenly, plus the
                      kept-whole layers every rank computes
    activations       FC nets: ``activation_bytes``; other models: twice the distinct tensors
                      autograd saves in rank 0's forward pass other than parameters (each held
                      until backward, then its gradient beside it), an upper bound since
                      backward frees them layer by layer

    The loss runs replicated on the gathered output and does not change the communication: a
    sum of squares stands in for it. ValueError (naming the layer) for a model partition_model
    cannot split F ways."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ..model_parallel import CountingComm, partition_model
    dtype = dtype or torch.float32
    with torch.device("meta"):
        full = model_fn().to(dtype)
    comm = CountingComm(F)
    part = partition_model(full, comm)
    x = torch.zeros(batch, *input_shape, dtype=input_dtype or dtype, device="meta")
    with FlopCounterMode(display=False) as counter:
        saved = _saved_bytes(part, x)
    counts = comm.group_counts()
    sizes = fc_sizes(full)
    acts = activation_bytes(sizes, F, batch, dtype.itemsize) if sizes else 2 * saved
    return StepCost(F, counter.get_total_flops(), counts["total_messages"],
                    counts["total_bytes"], sum(p.numel() for p in part.parameters()), acts,
                    sum(p.numel() for p in full.parameters()))


def _saved_bytes(model, x) -> int:
    """Bytes of the distinct tensors autograd saves in a forward of ``model`` on ``x`` (both
    on the meta device) other than its parameters, then a backward of a sum of squares of the
    output (the loss's stand-in)."""
    import torch
    # a storage's identity: _cdata (meta storages have no address)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}                     # storage -> bytes

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        loss = out.pow(2).sum()
    loss.backward()
    return sum(saved.values())


def saved_activation_bytes(model, input_shape: tuple, batch: int, dtype=None,
                           input_dtype=None) -> int:
    """What a step of the whole ``model`` (built on the meta device) keeps for backward on a
    batch of ``batch`` inputs of shape ``input_shape``: twice the distinct tensors autograd
    saves other than the parameters (each held until backward, then its gradient beside
    it), as ``step_cost`` counts them for a model it cannot price by formula."""
    import torch
    x = torch.zeros(batch, *input_shape, dtype=input_dtype or dtype or torch.float32,
                    device="meta")
    return 2 * _saved_bytes(model, x)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What the planner needs to know: task slots and their memory, the link, and one task's
    compute rate (``probe_flops``; measured by fit(partitions="auto") on the cluster)."""
    slots: int                         # executors x cores / spark.task.cpus
    memory_bytes: int                  # per task (e.g. spark.executor.pyspark.memory / cores)
    link: Link
    flops_per_s: float = 2e10          # one task's dense matmul rate (probe_flops)
    server_link: Link | None = None    # tasks <-> the driver's parameter server (default: link)


@dataclasses.dataclass(frozen=True)
class Plan:
    partitions: int
    replicas: int
    step_seconds: float
    table: list                        # one row per candidate F
    explanation: str


def plan(model, batch: int, cluster: Cluster, optimizer_slots: int = 1, itemsize: int = 4,
         candidates: list[int] | None = None, parameter_server: bool = True,
         input_shape: tuple | None = None) -> Plan:
    """Choose F (and R = slots // F) for ``model`` trained with the all-gather / all-reduce
    layers: the F with the least predicted time per sample among those whose task memory
    (slice of parameters, gradients and ``optimizer_slots`` optimizer states, plus the
    activations) fits. ``model``: an FC net's layer widths (priced by ``fc_step_cost``), or a
    zero-argument factory of any model ``partition_model`` splits, with ``input_shape`` (one
    sample's; priced by ``step_cost``, in float32 or float64 by ``itemsize``; candidates the
    model is too narrow for are left out). Prediction per step: the busiest task's flops at
    ``flops_per_s``, the counted collectives on the link, and (``parameter_server``: Downpour
    pushing and fetching every step) each replica's push and fetch of its P parameters, the
    R replicas sharing the server's link."""
    candidates = candidates or [f for f in (1, 2, 3, 4, 6, 8, 12, 16) if f <= cluster.slots]
    costs = _step_costs(model, batch, itemsize, candidates, input_shape)
    server = cluster.server_link or cluster.link
    rows, best = [], None
    for cost in costs:
        F, params = cost.partitions, cost.model_parameters
        state = cost.parameters * itemsize * (2 + optimizer_slots)
        comp = cost.flops / cluster.flops_per_s
        comm = predict_seconds({"messages": cost.messages, "bytes": cost.bytes}, cluster.link)
        R = max(cluster.slots // F, 1)
        # push + fetch: the F tasks send their slices at once, the R replicas share the link
        ps = 2 * (server.t_lat + R * params * itemsize * server.t_data) \
            if parameter_server else 0.0
        step = comp + comm + ps
        per_sample = step / (batch * R)
        fits = state + cost.activation_bytes <= cluster.memory_bytes
        rows.append({"F": F, "R": R, "state_bytes_per_task": int(state),
                     "activation_bytes_per_task": int(cost.activation_bytes), "fits": fits,
                     "compute_s": comp, "comm_s": comm, "ps_s": ps, "step_s": step,
                     "samples_per_s": batch * R / step})
        if fits and (best is None or per_sample < best[0]):
            best = (per_sample, F, R, step)
    if best is None:
        last = costs[-1]
        need = last.model_parameters * itemsize * (2 + optimizer_slots)
        raise ValueError(f"no partitioning in {[c.partitions for c in costs]} fits: the model "
                         f"needs {need} bytes of parameters, gradients and optimizer state "
                         f"(and {last.activation_bytes} of activations at "
                         f"F={last.partitions}), a task has {cluster.memory_bytes}; add "
                         f"executors or memory")
    _, F, R, step = best
    row = next(r for r in rows if r["F"] == F)
    why = (f"F={F}, R={R}: a task holds {row['state_bytes_per_task'] / 2**20:.1f} MiB of the "
           f"model's state and {row['activation_bytes_per_task'] / 2**20:.1f} MiB of "
           f"activations (limit {cluster.memory_bytes / 2**20:.0f} MiB); predicted step "
           f"{step * 1e3:.2f} ms = compute {row['compute_s'] * 1e3:.2f} ms (at "
           f"{cluster.flops_per_s / 1e9:.1f} Gflop/s) + layers' communication "
           f"{row['comm_s'] * 1e3:.2f} ms + parameter server {row['ps_s'] * 1e3:.2f} ms, "
           f"{row['samples_per_s']:.0f} samples/s over {R} replica(s)")
    return Plan(F, R, step, rows, why)


def _step_costs(model, batch: int, itemsize: int, candidates: list[int],
                input_shape: tuple | None) -> list[StepCost]:
    """StepCost of every candidate F: by formula for FC widths, else measured; an F the model
    is too narrow for is skipped, once a smaller one has shown the model splits at all."""
    if not callable(model):
        return [fc_step_cost(list(model), F, batch, itemsize) for F in candidates]
    import torch
    dtypes = {4: torch.float32, 8: torch.float64}
    if itemsize not in dtypes:
        raise ValueError(f"itemsize must be 4 (float32) or 8 (float64), got {itemsize}")
    if input_shape is None:
        raise ValueError("plan(model_fn, ...) needs input_shape, one sample's shape "
                         "(e.g. (1, 28, 28))")
    costs = []
    for F in candidates:
        try:
            costs.append(step_cost(model, tuple(input_shape), F, batch, dtypes[itemsize]))
        except ValueError:
            if not costs:
                raise
    return costs


def probe_cluster(spark, timeout_s: float = 120.0, with_flops: bool = False):
    """T_lat and T_data between two tasks of the running cluster: a 2-task barrier stage
    rendezvous (gloo) and runs ``probe``. A few seconds; needs two free task slots. With
    ``with_flops``: (Link, a task's matmul rate in flop/s from ``probe_flops``)."""
    import json as _json
    import secrets as _secrets

    secret = _secrets.token_hex(16)

    def task(batches):
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        from spark_dl.model_parallel import Comm
        from spark_dl.transport.rendezvous import process_group
        ctx = BarrierTaskContext.get()
        import torch
        torch.set_num_threads(int(ctx.cpus() or 1))
        flops = probe_flops()
        with process_group(ctx, "gloo", secret, {"error": None}, timeout_s) as (rank, _, _s):
            link = probe(Comm())
        for _ in batches:
            pass
        if rank == 0:
            yield pa.RecordBatch.from_pydict({"probe": [_json.dumps(
                {"t_lat": link.t_lat, "t_data": link.t_data, "flops": flops})]})

    # a DataFrame, not an RDD: Spark Connect sessions have no SparkContext
    out = spark.range(2, numPartitions=2).mapInArrow(task, "probe string", barrier=True) \
        .collect()
    got = _json.loads(out[0].probe)
    flops = got.pop("flops")
    return (Link(**got), flops) if with_flops else Link(**got)


def probe_task_speeds(spark, tasks: int) -> list[dict]:
    """Every task's matmul rate (``probe_flops``) in a barrier stage of ``tasks`` tasks, as
    the training stage of that many tasks will be placed: [{"task", "host", "flops"}] by task
    index. A second or two."""
    import json as _json

    def task(batches):
        import pyarrow as pa
        import torch
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
        torch.set_num_threads(int(ctx.cpus() or 1))
        ctx.barrier()                                          # all measure at the same time
        flops = probe_flops(repeats=9)
        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"probe": [_json.dumps(
            {"task": ctx.partitionId(), "host": os.uname().nodename, "flops": flops})]})

    rows = spark.range(tasks, numPartitions=tasks).mapInArrow(task, "probe string",
                                                                 barrier=True).collect()
    return sorted((_json.loads(r.probe) for r in rows), key=lambda r: r["task"])


def partition_speeds(flops: list[float], partitions: int) -> list[float]:
    """Each partition's speed from its tasks' (task r F + p is partition p of replica r): the
    median over the replicas, the widths that the replicas share."""
    import statistics
    return [statistics.median(flops[p::partitions]) for p in range(partitions)]


def flat_input_shape(model) -> tuple[int] | None:
    """(n,) when the first layer with parameters reads n flat features (a Linear layer or an
    SSDA's DenoisingLayer), else None."""
    from torch import nn

    from ..models.ssda import DenoisingLayer
    first = next((m for m in model.modules() if len(list(m.parameters(recurse=False)))), None)
    if isinstance(first, nn.Linear):
        return (first.in_features,)
    if isinstance(first, DenoisingLayer):
        return (first.weight.shape[1],)
    return None


def fc_sizes(model) -> list[int] | None:
    """Layer widths b_0 .. b_{n-1} of a model whose trainable layers are a chain of Linear
    layers (an FC net), else None."""
    from torch import nn
    layers = [m for m in model.modules() if len(list(m.parameters(recurse=False)))]
    if not layers or not all(isinstance(m, nn.Linear) for m in layers):
        return None
    if any(a.out_features != b.in_features for a, b in itertools.pairwise(layers)):
        return None
    return [layers[0].in_features] + [m.out_features for m in layers]
