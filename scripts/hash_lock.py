"""Writes the sha256 hash of every pinned file into requirements/cpu.lock, so that installing the
lock checks each file it installs (``pip install --require-hashes``, as scripts/setup_venv.sh does).

Neither uv nor pip-tools is on the build machines, so pip itself picks the files: a dry-run
install of the lock (``--no-deps``, nothing is installed) with ``--report`` records, for each
pin, the file pip chose for this kind of machine (Linux x86_64, CPython 3.11) and its hash. The
lock is therefore hashed for this platform only; elsewhere rerun this script.

    .venv/bin/python scripts/hash_lock.py [requirements/cpu.lock]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name


def pins(lock: Path) -> list[str]:
    """The lock's ``name==version`` lines, without any hashes already in it."""
    found = []
    for line in lock.read_text().splitlines():
        pin = line.split("--hash")[0].strip().rstrip("\\").strip()
        if pin and not pin.startswith("#") and "==" in pin:
            found.append(pin)
    return found


def chosen_files(requirements: list[str]) -> dict[str, str]:
    """Canonical name -> sha256 of the file pip would install for each requirement."""
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp, "plain.txt")
        plain.write_text("\n".join(requirements) + "\n")
        report = Path(tmp, "report.json")
        dry_run = ["install", "--quiet", "--dry-run", "--ignore-installed", "--no-deps", "--report", str(report)]
        subprocess.run([sys.executable, "-m", "pip", *dry_run, "-r", str(plain)], check=True)
        installs = json.loads(report.read_text())["install"]
    hashes = {}
    for item in installs:
        archive = item["download_info"].get("archive_info", {})
        digest = archive.get("hashes", {}).get("sha256") or archive.get("hash", "").removeprefix("sha256=")
        hashes[canonicalize_name(item["metadata"]["name"])] = digest
    return hashes


def main() -> int:
    lock = Path(sys.argv[1] if len(sys.argv) > 1 else "requirements/cpu.lock")
    requirements = pins(lock)
    hashes = chosen_files(requirements)
    lines, missing = [], []
    for pin in requirements:
        digest = hashes.get(canonicalize_name(pin.split("==")[0]))
        if not digest:
            missing.append(pin)
        lines.append(f"{pin} \\\n    --hash=sha256:{digest}" if digest else pin)
    if missing:
        print(f"pip gave no hash for: {', '.join(missing)}; the lock is left as it was", file=sys.stderr)
        return 1
    lock.write_text("\n".join(lines) + "\n")
    print(f"{lock}: {len(lines)} pins, each with the hash of the file pip installs here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
