#!/usr/bin/env bash
# Set up .venv (once) and run the whole test suite, slow tier included.
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not slow" for the fast tier only.
source "$(dirname "$0")/_env.sh"
exec python -m pytest "$@"
