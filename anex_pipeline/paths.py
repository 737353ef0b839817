"""The folders the pipeline keeps its own files in, each from its environment variable or under
one cache folder. Nothing here creates a folder, and nothing here imports the rest of the
package but the settings, so any layer can ask where a folder is."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from anex_pipeline import settings


def _configured(setting: settings.Setting) -> Path | None:
    """The folder a setting names (``~`` expanded), or None when it is unset or empty."""
    configured = setting.get()
    return Path(configured).expanduser() if configured else None


def cache_root() -> Path:
    """The folder under which the pipeline keeps derived files such as models:
    ``$ANEX_CACHE_DIR``, else ``~/.cache/anex-pipeline``."""
    return _configured(settings.CACHE_DIR) or Path.home() / ".cache" / "anex-pipeline"


def models_dir() -> Path:
    """Where the bundled models are converted to (``models`` in the cache folder)."""
    return cache_root() / "models"


def media_cache_dir() -> Path:
    """Where downloaded media are kept: ``$ANEX_MEDIA_CACHE_DIR``, else ``media`` in the cache folder."""
    return _configured(settings.MEDIA_CACHE_DIR) or cache_root() / "media"


def default_work_root() -> str:
    """``$ANEX_WORK_DIR``, else ``work`` in the cache folder."""
    return settings.WORK_DIR.get() if settings.WORK_DIR.is_set() else str(cache_root() / "work")


def machine_server_dir() -> Path:
    """The shared model server's state folder: ``$ANEX_MACHINE_SERVER_DIR`` if set (processes that
    must not meet the machine's usual server, such as tests), else ``machine-server`` in the cache
    folder."""
    return _configured(settings.MACHINE_SERVER_DIR) or cache_root() / "machine-server"


def dagster_home() -> Path:
    """The command line's Dagster instance folder: ``$DAGSTER_HOME``, else ``dagster_home`` in the
    cache folder."""
    return Path(settings.DAGSTER_HOME.get() or cache_root() / "dagster_home")


def private_problem(path: Path, st: os.stat_result) -> str | None:
    """What makes a folder or file of the pipeline's (``path``, as ``st`` describes it) unfit to be
    trusted by this user: another user's, or writable by others; None when it is this user's alone."""
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} may be written by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None
