#!/usr/bin/env bash
# One command on a fresh machine: set up, then run the test suite. Extra arguments go to pytest.
# CPU machine (CI): one run; Triton kernels run under TRITON_INTERPRET=1, GPU-only tests are skipped with a reason.
# Machine with a CUDA GPU: two runs, since one process either interprets Triton kernels or compiles them: the CPU
# half with CUDA hidden (exactly what CI runs), then the tests marked gpu (tests/conftest.py).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "== a CUDA GPU is present: running the CPU half (CUDA hidden), then the GPU half"
    cpu=0; gpu=0
    CUDA_VISIBLE_DEVICES= python -m pytest -q -p no:cacheprovider -m "not gpu" "$@" || cpu=$?
    echo "== running the GPU tests (-m gpu)"
    python -m pytest -q -p no:cacheprovider -m gpu "$@" || gpu=$?
    echo "== CPU half exit $cpu, GPU half exit $gpu"
    [ "$cpu" -eq 0 ] && [ "$gpu" -eq 0 ]
else
    echo "== running tests"
    python -m pytest -q -p no:cacheprovider "$@"
fi
