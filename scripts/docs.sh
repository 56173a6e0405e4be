#!/usr/bin/env bash
# Build and serve the documentation site (mkdocs + mkdocs-material + mkdocstrings) from .venv.
#   scripts/docs.sh          serve it at http://127.0.0.1:8000 (rebuilt on every change)
#   scripts/docs.sh build    build it strictly into site/ (a broken link or reference fails)
source "$(dirname "$0")/_env.sh"
export NO_MKDOCS_2_WARNING=1
if [ "${1:-serve}" = "build" ]; then
  exec python -m mkdocs build --strict
fi
exec python -m mkdocs serve --strict -a 127.0.0.1:8000
