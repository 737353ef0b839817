#!/usr/bin/env bash
# Makes sure a PostgreSQL server is installed, for the tests that run the production instance
# config (deploy/dagster.yaml) against a real server on loopback. Those tests start and stop their
# own server in a temporary folder; this script only installs Debian's `postgresql` package when
# no `initdb` is found on PATH or under /usr/lib/postgresql/*/bin. Quiet when nothing is to do.
set -euo pipefail

have_initdb() {
    command -v initdb >/dev/null 2>&1 && return 0
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}

have_initdb && exit 0

# shellcheck source=scripts/apt_install.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt_install.sh"
if ! apt_can_install; then
    echo "ensure_postgres: PostgreSQL is not installed, and installing it needs root (or" \
        "password-less sudo) and apt-get. Install Debian's 'postgresql' package, then run this again." >&2
    exit 1
fi

echo "ensure_postgres: installing Debian's postgresql package (once) for the PostgreSQL instance tests" >&2
if ! apt_install postgresql; then
    cat "$APT_LOG" >&2
    echo "ensure_postgres: installing the postgresql package failed (apt output above)" >&2
    exit 1
fi

if ! have_initdb; then
    echo "ensure_postgres: the postgresql package is installed but no initdb was found" \
        "under /usr/lib/postgresql/*/bin" >&2
    exit 1
fi
