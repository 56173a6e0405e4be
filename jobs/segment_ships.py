"""Segment ships with the seed-000 U-Net on synthetic satellite scenes made in the executors,
trained by default with the boosting parameter server and its data-key scheduler (a push
per key of 2 mini-batches, the seed's 4 with Boosting(n_push=4); keys reshuffled every
epoch); IoU / Dice / Airbus F2 of held-out scenes and a picture strip.

    spark-submit jobs/segment_ships.py --config conf/jobs/ships.toml
    python jobs/segment_ships.py --set train.strategy=allreduce
"""
import sys

from spark_dl.recipes.cli import run_job
from spark_dl.recipes.ships import ShipsJobConfig, segment_ships

if __name__ == "__main__":
    run_job(__doc__, ShipsJobConfig, segment_ships, "conf/jobs/ships.toml",
            lambda c: f"ships-unet-{c.train.strategy}", sys.argv[1:])
