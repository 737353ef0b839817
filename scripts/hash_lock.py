"""Adds sha256 hashes to requirements/cpu.lock, so that installing it checks every file
(``pip install --require-hashes``).

Neither uv nor pip-tools is available on the build machines, so this reads the hashes the
package index publishes: each pin gets the hash of every file of that exact version the index
lists (every platform's wheel and the sdist, as ``pip-compile --generate-hashes`` does), and
files found in a find-links folder (the CPU torch wheel) are hashed here. The indexes and
folders are pip's own configuration unless given.

    .venv/bin/python scripts/hash_lock.py [--lock requirements/cpu.lock] [--index URL ...] [--find-links DIR ...]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

LINK = re.compile(r'href="([^"#]+)#sha256=([0-9a-f]{64})"')


def pip_setting(name: str) -> list[str]:
    found = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", name], capture_output=True, text=True, check=False
    )
    return found.stdout.split() if found.returncode == 0 else []


def file_version(filename: str) -> tuple[str, Version] | None:
    try:
        if filename.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(filename)
        else:
            name, version = parse_sdist_filename(filename)
    except ValueError:
        return None
    return canonicalize_name(name), version


def index_hashes(index: str, name: str, version: Version) -> list[str]:
    url = f"{index.rstrip('/')}/{canonicalize_name(name)}/"
    try:
        with urllib.request.urlopen(url if not url.startswith("file:") else url + "index.html") as page:
            html = page.read().decode()
    except OSError:
        return []
    return [
        digest
        for href, digest in LINK.findall(html)
        if file_version(href.rsplit("/", 1)[-1]) == (canonicalize_name(name), version)
    ]


def folder_hashes(folder: str, name: str, version: Version) -> list[str]:
    return [
        hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(Path(folder.removeprefix("file://")).glob("*"))
        if file_version(path.name) == (canonicalize_name(name), version)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lock", default="requirements/cpu.lock")
    parser.add_argument("--index", action="append", help="a simple index URL (default: pip's index-url and extra-index-url)")
    parser.add_argument("--find-links", action="append", help="a folder of wheels (default: pip's find-links)")
    args = parser.parse_args()
    indexes = args.index or pip_setting("global.index-url") + pip_setting("global.extra-index-url")
    folders = args.find_links or pip_setting("global.find-links")
    lock = Path(args.lock)
    out, missing = [], []
    for line in lock.read_text().splitlines():
        pin = line.split("--hash")[0].strip().rstrip("\\").strip()
        if not pin or pin.startswith("#"):
            if not line.startswith("    --hash"):
                out.append(line)
            continue
        name, _, text = pin.partition("==")
        version = Version(text)
        hashes = sorted({h for i in indexes for h in index_hashes(i, name, version)} | {
            h for f in folders for h in folder_hashes(f, name, version)
        })
        if not hashes:
            missing.append(pin)
            out.append(pin)
            continue
        out.append(f"{pin} \\")
        out += [f"    --hash=sha256:{h}" + (" \\" if n < len(hashes) - 1 else "") for n, h in enumerate(hashes)]
    if missing:
        print(f"no file found for: {', '.join(missing)}; the lock is left as it was", file=sys.stderr)
        return 1
    lock.write_text("\n".join(out) + "\n")
    print(f"{lock}: {sum(1 for line in out if '==' in line)} pins, each with its files' hashes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
