#!/usr/bin/env bash
# The GPU check, one command for a machine with NVIDIA GPUs and no internet: the example, the
# 2,048-row benchmark against vLLM's run_batch, an FP8 KV-cache run, tensor parallel 2 (with two
# GPUs), three Batch API batches against one, then one table. See bench/gpu_check.py.
#
#   bench/gpu_check.sh [--dry-run] [--gpus N] [--out DIR] [--budget-s S]
#
# It runs this working tree (on PYTHONPATH, nothing installed) on the machine's own Python with
# vLLM's GPU build and torch: $ANEX_GPU_PYTHON if set, else the first of .venv/bin/python and
# python3 that has the `vllm` distribution. When none has it (or a dependency is missing), it
# says in one line what is missing and exits 2.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

has_vllm() { "$1" -c 'from importlib import metadata; metadata.version("vllm")' >/dev/null 2>&1; }

python="${ANEX_GPU_PYTHON:-}"
if [ -z "$python" ]; then
    for candidate in "$repo/.venv/bin/python" "$(command -v python3 || true)"; do
        if [ -n "$candidate" ] && [ -x "$candidate" ]; then
            [ -z "$python" ] && python="$candidate"  # the fallback that will say what it lacks
            if has_vllm "$candidate"; then python="$candidate"; break; fi
        fi
    done
fi
if [ -z "$python" ] || ! [ -x "$(command -v "$python" || true)" ]; then
    echo "gpu_check: no Python found (looked at \$ANEX_GPU_PYTHON, .venv/bin/python, python3); install Python 3.11 with vllm" >&2
    exit 2
fi

cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m bench.gpu_check "$@"
