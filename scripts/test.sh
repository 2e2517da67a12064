#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite. Exits non-zero if any test fails,
# and also when pytest collects no test at all (its exit status 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"
