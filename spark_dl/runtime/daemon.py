"""pyspark's Python worker daemon, with torch imported once before it forks the workers.

Spark starts one daemon per executor (``python -m <spark.python.daemon.module>``) and forks a
Python worker from it whenever a task needs one that is not idle. Every fresh worker then
imports torch (about 2 s on one core) and, when it makes its first optimizer, torch._dynamo
(about 2 s more): a fit's tasks paid 3-4 s of set-up before their first step, every fit, as
Spark rarely hands a fit the workers of the one before. As the daemon module
(``spark.python.daemon.module spark_dl.runtime.daemon``, which the ``local`` and
``local-cluster`` profiles set) this module imports them in the daemon, and every forked worker
starts with them loaded (copy-on-write pages, nothing copied).

Only imports run before the fork, and only torch's: pyspark's rule is that no thread may be
started before it forks, and pyarrow and pandas start thread pools when imported (so neither
is imported here, nor spark_dl itself, which imports pyarrow); torch starts its intra-op
threads at the first parallel operation, not at import. Profiles for clusters where spark_dl
reaches the executors in a zip (``--py-files``) leave the setting out: the daemon starts before
the zip is on the path.
"""

from __future__ import annotations


def _preload() -> None:
    # torch._dynamo: every optimizer imports it when it is made
    import torch
    import torch._dynamo
    import torch.distributed
    import torch.optim  # noqa: F401


if __name__ == "__main__":
    _preload()
    from pyspark import daemon
    daemon.manager()
