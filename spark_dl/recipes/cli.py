"""Command line of the training jobs: --config TOML, --set KEY=VALUE overrides, results file."""

from __future__ import annotations

import argparse
import ast
import json
from collections.abc import Callable

from ..config import load_toml
from .common import write_result

__all__ = ["parse_overrides", "run_job"]


def parse_overrides(pairs: list[str]) -> dict:
    """["train.lr=0.1", "train.model='fc'"] -> {"train.lr": 0.1, "train.model": "fc"}."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects KEY=VALUE, got {pair!r}")
        if value.lower() in ("true", "false"):            # TOML spelling of booleans
            out[key] = value.lower() == "true"
            continue
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value                      # a bare word: keep it as a string
    return out


def run_job(doc: str, config_cls, recipe: Callable, default_config: str, name: Callable,
            argv=None) -> dict:
    """Parse args, load the config, run ``recipe(cfg)``, write ``<run.out_dir>/<name>.json``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=default_config, help="job TOML (conf/jobs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set run.device=cpu --set epochs=2")
    args = p.parse_args(argv)
    cfg = load_toml(config_cls, args.config, parse_overrides(args.set))
    result = recipe(cfg)
    path = write_result(cfg.run, name(cfg), {"config": args.config, "overrides": args.set,
                                             **result})
    summary = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
    print(json.dumps(summary, indent=1))
    print(f"results written to {path}")
    return result
