"""Train SRCNN (9-5-5) on T91 for ×scale super-resolution; PSNR on Set5 against bicubic.

    python jobs/train_srcnn.py --config conf/jobs/srcnn.toml
"""
import sys

from spark_dl.recipes.cli import run_job
from spark_dl.recipes.superres import SRCNNConfig, train_srcnn

if __name__ == "__main__":
    run_job(__doc__, SRCNNConfig, train_srcnn, "conf/jobs/srcnn.toml",
            lambda c: f"srcnn-x{c.scale}", sys.argv[1:])
