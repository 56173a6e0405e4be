"""Train a character-level LSTM or RNN (tBPTT, RMSprop) and sample text from it.

    python jobs/train_char.py --config conf/jobs/char_lstm.toml [--set updates=500 ...]
"""
import sys

from spark_dl.recipes.charlm import CharConfig, train_char
from spark_dl.recipes.cli import run_job

if __name__ == "__main__":
    run_job(__doc__, CharConfig, train_char, "conf/jobs/char_lstm.toml",
            lambda c: f"char-{c.kind}-{c.layers}x{c.hidden}"
            + ("" if c.strategy == "single" else f"-{c.strategy}")
            + (f"-{c.partitions}parts" if c.partitions > 1 else ""), sys.argv[1:])
