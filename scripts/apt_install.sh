# Sourced by the ensure_* scripts: Debian packages installed as root, or through password-less
# sudo, with apt's chatter kept in a log ($APT_LOG) that the caller shows only if it wants to.

# Sets APT_AS_ROOT to what runs a command as root; fails when nothing can (or apt-get is missing).
apt_can_install() {
    command -v apt-get >/dev/null 2>&1 || return 1
    if [[ "$(id -u)" == 0 ]]; then
        APT_AS_ROOT=()
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        APT_AS_ROOT=(sudo -n)
    else
        return 1
    fi
}

# apt_install PACKAGE...: after apt_can_install; apt's output goes to $APT_LOG (removed at exit).
apt_install() {
    APT_LOG="$(mktemp)"
    trap 'rm -f "$APT_LOG"' EXIT
    { "${APT_AS_ROOT[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
        "${APT_AS_ROOT[@]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "$@"; } >"$APT_LOG" 2>&1
}
