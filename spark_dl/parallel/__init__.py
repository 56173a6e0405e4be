"""``spark_dl.parallel.cost_model``, where users were shown the cost model and planner
(notebooks/02_model_parallelism.ipynb): it lives in ``spark_dl.planning.cost_model``, and this
name keeps working, for ``from spark_dl.parallel import cost_model`` and
``import spark_dl.parallel.cost_model`` alike. Nothing else is here."""

import sys

from ..planning import cost_model

sys.modules[__name__ + ".cost_model"] = cost_model

__all__ = ["cost_model"]
