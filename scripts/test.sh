#!/usr/bin/env bash
# One command on a fresh machine: set up, then run the test suite (CPU: Triton kernels run under
# TRITON_INTERPRET=1; GPU-only tests are skipped with a reason). Extra arguments go to pytest.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
echo "== running tests"
python -m pytest -q -p no:cacheprovider "$@"
