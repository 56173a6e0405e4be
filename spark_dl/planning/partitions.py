"""Model-parallel replicas of Downpour: ``partitions="auto"`` (the cost model's planner, with the
link probed on the cluster), the ``model_parallel`` algorithms and the checks of the master
algorithm (model_parallel/master.py), and how the parameter server lays out a partitioned
model."""

from __future__ import annotations

import torch

from ..errors import ConfigError

__all__ = ["MODEL_PARALLEL", "Layout", "check_master_backprop", "choose",
           "model_parallel_algorithm", "plan_partitions", "task_memory"]

MODEL_PARALLEL = ("collective", "master")      # how partitions > 1 split a replica's model
_ALIASES = {"thesis": "master"}                # the master algorithm's former name


def plan_partitions(spark, model_fn, shape, batch_size, slots, dtype, log,
                    optimizer: str = "sgd", momentum: float = 0.0) -> tuple[int, int]:
    """partitions="auto": F and R from cost_model.plan (a step of the model priced on the meta
    device, inputs of ``shape``, or the first layer's width for flat features), with the link
    probed on the cluster; ``choose`` adds what FSDP would need (fit's ``optimizer``)."""
    from . import cost_model
    with torch.device("meta"):
        shape = tuple(shape) or cost_model.flat_input_shape(model_fn())
    if not shape:
        raise ConfigError("partitions='auto' prices a step of the model on inputs of its shape, "
                          "which its first layer does not give: pass shape= (one sample's, "
                          "e.g. shape=(1, 28, 28))")
    try:                       # a model it cannot run or split fails here, before the probe
        cost_model.step_cost(model_fn, shape, 1, batch_size, getattr(torch, dtype))
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"partitions='auto' cannot price this model on inputs of shape "
                          f"{shape}: {e}") from e
    if slots >= 2:
        link, flops = cost_model.probe_cluster(spark, with_flops=True)
    else:
        link, flops = cost_model.Link(0.0, 0.0), cost_model.probe_flops()
    cluster = cost_model.Cluster(slots, task_memory(spark), link, flops)
    plan = choose(model_fn, shape, batch_size, cluster, dtype, optimizer, momentum)
    if log is not None:
        log(f"partitions='auto': {plan.explanation} (link: {link.t_lat * 1e6:.0f} us per "
            f"message, {link.t_data * 1e9:.2f} ns per byte)")
    return plan.partitions, plan.replicas


def choose(model_fn, shape: tuple, batch_size: int, cluster, dtype: str,
           optimizer: str = "sgd", momentum: float = 0.0):
    """cost_model.plan's pick of F and R for the column split, said beside FSDP: where the
    whole model fits a task (F = 1) nothing is split; where it does not, the explanation says
    whether FSDP over the cluster's slots would fit as well, and where no F fits, the
    ResourceError says whether FSDP does. FSDP's figure is strategies/fsdp/memory.py's rule
    (``optimizer``'s state) on the planner's basis: the model's state, gathered units and
    activations against a task's memory, without the worker's own footprint (FSDP's check in
    fit adds it)."""
    import dataclasses

    from ..errors import ResourceError
    from . import cost_model

    def fsdp() -> str:
        return _fsdp(model_fn, shape, batch_size, cluster, dtype, optimizer, momentum)

    try:
        plan = cost_model.plan(model_fn, batch_size, cluster,
                               itemsize=8 if dtype == "float64" else 4, input_shape=shape)
    except ValueError as e:
        if not str(e).startswith("no partitioning"):
            raise
        raise ResourceError(f"partitions='auto': {e}; {fsdp()} (strategy=FSDP())") from None
    if plan.partitions == 1:
        why = "F=1: the whole model fits a task, nothing to split (nor to shard with FSDP)"
    else:
        why = (f"F={plan.partitions}: the whole model does not fit a task; {fsdp()} "
               f"(strategy=FSDP()); the column split also divides each layer's compute")
    return dataclasses.replace(plan, explanation=f"{plan.explanation}; {why}")


def _fsdp(model_fn, shape, batch_size, cluster, dtype, optimizer, momentum) -> str:
    """What FSDP over the cluster's slots would need, and whether it fits, in a few words."""
    from ..strategies.fsdp.memory import OPTIMIZER_SLOTS, model_estimate, verdict
    if optimizer not in OPTIMIZER_SLOTS:
        return f"FSDP does not train with optimizer {optimizer!r}"
    with torch.device("meta"):
        model = model_fn()
    _, est = model_estimate(model, None, getattr(torch, dtype), optimizer, momentum,
                            shape=shape, batch_size=batch_size, margin=0)
    return verdict(est, cluster.slots, cluster.memory_bytes)


UNLIMITED = 1 << 62                            # task_memory without a limit


def task_memory(spark) -> int:
    """Bytes a task's Python worker may use: spark.executor.pyspark.memory over the executor's
    cores (unset: ``UNLIMITED``)."""
    value = spark.conf.get("spark.executor.pyspark.memory", None)
    if not value:
        return UNLIMITED
    import re
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(b?)\s*", value.lower())
    if not m:
        raise ConfigError(f"spark.executor.pyspark.memory={value!r} is not a size such as "
                          f"'2g' or '512m'")
    number, unit, b = m.groups()
    scale = {"": 1 if b else 1 << 20, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30,
             "t": 1 << 40, "p": 1 << 50}[unit]
    size = int(float(number) * scale)
    cores = int(spark.conf.get("spark.executor.cores", "1") or 1)
    return size // max(cores, 1)



def model_parallel_algorithm(value) -> str:
    """``model_parallel``: "collective" (each layer's all-gather and all-reduce) or "master"
    (distributed backpropagation through a master, FC nets); "thesis" is accepted as "master".
    Returns the algorithm's name; a ConfigError for another value."""
    name = _ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in MODEL_PARALLEL:
        raise ConfigError(f"model_parallel must be one of {', '.join(map(repr, MODEL_PARALLEL))}"
                          f" ('thesis' is accepted as 'master'), got {value!r}")
    return name


def check_master_backprop(model_fn, loss_name: str, partitions) -> None:
    """model_parallel='master' runs FC nets with softmax cross-entropy, every layer split."""
    from ..model_parallel import fc_activation
    from . import cost_model
    with torch.device("meta"):
        net = model_fn()
    sizes = cost_model.fc_sizes(net)
    if sizes is None:
        raise ConfigError("model_parallel='master' runs FC nets (a chain of Linear layers); "
                          "use model_parallel='collective' for this model")
    try:
        fc_activation(net)
    except ValueError as e:
        raise ConfigError(f"model_parallel='master': {e}") from None
    if loss_name != "cross_entropy":
        raise ConfigError(f"model_parallel='master' trains with softmax cross-entropy, not "
                          f"{loss_name!r}")
    if isinstance(partitions, int) and min(sizes[1:]) < partitions:
        raise ConfigError(f"model_parallel='master' splits every layer: a layer of "
                          f"{min(sizes[1:])} units cannot go over partitions={partitions}")



class Layout:
    """How the parameter server lays out a model's parameters: the flat parameter vector, or
    with F partitions, partition 0's slices, then partition 1's, ... (shard p = partition p).
    Its floating-point buffers (BatchNorm's running statistics) travel as partition 0's
    (``buffer_spec``: a split model keeps its normalisation layers whole, on partition 0)."""

    def __init__(self, net: torch.nn.Module, partitions: int, widths=None):
        from ..model_parallel import Comm, partition_model
        self.net, self.F = net, partitions
        self.widths = None if widths is None else [float(w) for w in widths]
        self.parts = [partition_model(net, Comm.layout(p, partitions, widths))
                      for p in range(partitions)] if partitions > 1 else [net]
        sizes = [sum(q.numel() for q in part.parameters() if q.requires_grad)
                 for part in self.parts]
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)] if partitions > 1 \
            else None

    def describe(self) -> dict:
        """For info.json: the partitions' sizes and the layers kept whole (too narrow to split:
        partition 0 trains them, the others receive its values every forward pass)."""
        from ..model_parallel import kept_whole
        return {"partitions": self.F, "widths": self.widths,
                "parameters_per_partition":
                [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])],
                "kept_whole": kept_whole(self.parts[0])}

    @property
    def buffer_spec(self) -> tuple:
        """(name, shape) of the buffers the workers report (spark_dl.transport.ps.buffers),
        named as in partition 0's model."""
        from ..transport.ps.buffers import buffer_spec
        return buffer_spec(self.parts[0])

    def flatten_buffers(self) -> torch.Tensor:
        """model_fn()'s values of ``buffer_spec``'s buffers, flat (the server's start)."""
        from ..transport.ps.buffers import read_buffers, spec_numel
        spec = self.buffer_spec
        return read_buffers(self.parts[0], spec, torch.empty(spec_numel(spec),
                                                              dtype=torch.float64))

    def flatten(self) -> torch.Tensor:
        return torch.cat([torch.nn.utils.parameters_to_vector(
            [q for q in part.parameters() if q.requires_grad]).detach() for part in self.parts])

    def load(self, flat: torch.Tensor, buffers: torch.Tensor | None = None) -> None:
        """The server's flat vector (and ``buffers``: its mean of the workers' buffers, as
        ``buffer_spec`` lays them out) into ``net`` (merging the partitions' slices)."""
        if buffers is not None:
            from ..transport.ps.buffers import load_buffers
            load_buffers(self.parts[0], self.buffer_spec, buffers)
        if self.F == 1:
            torch.nn.utils.vector_to_parameters(
                flat, [q for q in self.net.parameters() if q.requires_grad])
            return
        from ..model_parallel import merge_partitions
        for part, a, b in zip(self.parts, self.bounds[:-1], self.bounds[1:]):
            torch.nn.utils.vector_to_parameters(
                flat[a:b], [q for q in part.parameters() if q.requires_grad])
        self.net.load_state_dict(merge_partitions(self.net, self.parts))


