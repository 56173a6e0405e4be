"""Count flowers with MCNN (seed 002) on synthetic scenes made in the executors: a distributed
fit on density maps, then MAE / RMSE / per-bin errors of held-out scenes and a picture strip.

    spark-submit jobs/count_objects.py --config conf/jobs/counting.toml
    python jobs/count_objects.py --set train.model=mcnn-deconv --set train.strategy=downpour
"""
import sys

from spark_dl.recipes.cli import run_job
from spark_dl.recipes.counting import CountingJobConfig, count_objects

if __name__ == "__main__":
    run_job(__doc__, CountingJobConfig, count_objects, "conf/jobs/counting.toml",
            lambda c: f"counting-{c.train.model}", sys.argv[1:])
