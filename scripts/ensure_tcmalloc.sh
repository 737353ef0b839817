#!/usr/bin/env bash
# Installs tcmalloc (Debian's libtcmalloc-minimal4) when it is missing, for vLLM's CPU engine
# processes: the pipeline preloads it into them (ANEX_CPU_PRELOAD, tcmalloc by default), and it
# generated about 4% faster on the build machine. It is an optimisation, so a machine where it
# cannot be installed (no root, no apt) gets one line and goes on. Quiet when nothing is to do.
set -uo pipefail

{ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep -q libtcmalloc_minimal.so.4 && exit 0

# shellcheck source=scripts/apt_install.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
if apt_can_install && apt_install libtcmalloc-minimal4; then
    echo "ensure_tcmalloc: installed Debian's libtcmalloc-minimal4 for vLLM's CPU engine" >&2
else
    echo "ensure_tcmalloc: tcmalloc is not installed and could not be (needs root and apt-get);" \
        "the CPU engine runs on the system allocator, about 4% slower" >&2
fi
exit 0
