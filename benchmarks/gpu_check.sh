#!/usr/bin/env bash
# On the GPU machine (no network; run from anywhere): install wheelhouse/ (made by `./dev wheelhouse`) over the machine's versions (an older typer there broke the CLI), then zeppelin from this tree (editable, no dependencies), then run the check (arguments go to gpu_check.py).
set -euo pipefail; cd "$(dirname "$0")/.."; PY="${PYTHON:-python3}"; "$PY" -m pip install -q --no-index --find-links wheelhouse --upgrade -r benchmarks/wheelhouse.txt && "$PY" -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 exec "$PY" benchmarks/gpu_check.py "$@"
