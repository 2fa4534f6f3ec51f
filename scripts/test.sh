#!/usr/bin/env bash
# Set up .venv/ with the dev extras, then lint, type-check and run the tests.
#   scripts/test.sh            the default suite (under 10 minutes on 2 cores)
#   scripts/test.sh --slow     only the tests marked slow
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh dev
# The image tests: skopeo and umoci check what we write, a real registry serves pulls, busybox
# and Debian's python3 and git make the test images.
scripts/debian.sh skopeo umoci docker-registry busybox-static git openssl patch python3
if [ "${1:-}" = "--slow" ]; then
  scripts/debian.sh mmdebstrap podman runc  # the SWE example's Debian image, the podman baseline
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/ruff check venusrl tests benchmarks examples
.venv/bin/ruff format --check venusrl tests benchmarks examples
.venv/bin/mypy
marker=(-m "not slow")
if [ "${1:-}" = "--slow" ]; then
  marker=(-m slow)
  shift
fi
.venv/bin/python -m pytest -p no:cacheprovider "${marker[@]}" "$@"
