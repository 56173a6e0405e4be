"""Train the reference loop inside one Spark task over a DataFrame's rows.

The stepping stone before the distributed engines: the rows reach the model through the
Arrow bridge inside an executor (nothing is collected to the driver); only the trained
weights come back, as ``torch.save`` bytes of the state dict.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pyarrow as pa

from .config import TrainConfig

__all__ = ["fit_single_task"]


def fit_single_task(df, cfg: TrainConfig, features: str = "features", label: str = "label",
                    num_classes: int = 10):
    """Returns (model, history): history is a list of per-epoch dicts (loss, samples, seconds)."""
    import torch

    from .models import build_model
    cfg_values = cfg                                    # frozen dataclass: plain values only

    def _train_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        # Runs on an executor: the whole (coalesced) data set is this task's shard.
        import json

        import torch

        from spark_dl.data.bridge import ShardData
        from spark_dl.models import build_model
        from spark_dl.train import make_optimizer, train_epoch

        torch.manual_seed(cfg_values.seed)
        shard = ShardData.from_arrow(batches, features, label, num_classes=num_classes,
                                     where="training data")
        model = build_model(cfg_values.model)
        opt = make_optimizer(cfg_values.optimizer, model.parameters(), cfg_values.lr,
                             cfg_values.momentum, nesterov=cfg_values.nesterov)
        history = [train_epoch(model, shard.batches(cfg_values.batch_size, seed=cfg_values.seed,
                                                   epoch=e), opt)
                   for e in range(cfg_values.epochs)]
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        yield pa.RecordBatch.from_pydict({"state": [buf.getvalue()],
                                          "history": [json.dumps(history)]})

    import json
    row = df.coalesce(1).mapInArrow(_train_task, "state binary, history string").first()
    model = build_model(cfg.model)
    model.load_state_dict(torch.load(io.BytesIO(row.state), weights_only=True))
    return model, json.loads(row.history)
