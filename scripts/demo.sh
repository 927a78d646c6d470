#!/usr/bin/env bash
# One command on a fresh machine: set up, then run the main job on the embedded default model.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
multilora demo "$@"
