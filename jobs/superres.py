"""Noise-resilient super-resolution: patch pairs from an image folder (Spark), the SSDA denoiser,
the SRCNN and the cascade trained with a distributed engine, the PSNR/SSIM report on Set5.

    spark-submit jobs/superres.py --config conf/jobs/superres.toml [--set strategy=downpour ...]
"""
import sys

from spark_dl.recipes.cli import run_job
from spark_dl.recipes.superres_pipeline import SuperResConfig, run_superres

if __name__ == "__main__":
    run_job(__doc__, SuperResConfig, run_superres, "conf/jobs/superres.toml",
            lambda c: f"superres-x{c.scale}-{c.noise}", sys.argv[1:])
