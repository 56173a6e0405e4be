"""Train the stacked sparse denoising autoencoder on noisy T91 patches; PSNR on Set5.

    python jobs/train_ssda.py --config conf/jobs/ssda.toml
"""
import sys

from spark_dl.recipes.cli import run_job
from spark_dl.recipes.superres import SSDAConfig, train_ssda

if __name__ == "__main__":
    run_job(__doc__, SSDAConfig, train_ssda, "conf/jobs/ssda.toml",
            lambda c: f"ssda-sigma{c.sigma:g}", sys.argv[1:])
