"""A real, throwaway PostgreSQL server for the tests (Debian's ``postgresql`` package,
which ``make test`` installs where it is missing).

The server runs as the ``postgres`` system user when the tests run as root (PostgreSQL
refuses to run as root), listens on a free loopback port, trusts local connections,
and skips durability (``fsync=off``): its data is gone when the session ends.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

USER = "sluice"


def binaries() -> Path | None:
    """The newest installed server's ``bin`` folder, if any."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


def _as_server_user() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@contextmanager
def running_postgres(port: int) -> Iterator[str]:
    """A started server; yields its DSN (database ``postgres``, user ``sluice``)."""
    bin_dir = binaries()
    if bin_dir is None:
        raise FileNotFoundError("PostgreSQL is not installed (apt-get install postgresql)")
    prefix = _as_server_user()
    # Not under pytest's tmp folders: those are private to root, and the server user
    # must own its data folder.
    base = Path(tempfile.mkdtemp(prefix="sluice-pg-"))
    if prefix:
        owner = pwd.getpwnam("postgres")
        os.chown(base, owner.pw_uid, owner.pw_gid)
    data, log = base / "data", base / "server.log"
    try:
        subprocess.run(
            [*prefix, str(bin_dir / "initdb"), "-D", str(data), "-U", USER, "-A", "trust",
             "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True,
        )  # fmt: skip
        with log.open("wb") as errors:
            proc = subprocess.Popen(
                [*prefix, str(bin_dir / "postgres"), "-D", str(data), "-p", str(port),
                 "-h", "127.0.0.1", "-k", str(base), "-c", "fsync=off",
                 "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
                stdout=subprocess.DEVNULL, stderr=errors,
            )  # fmt: skip
        try:
            _wait_ready(bin_dir, port, proc, log)
            yield f"postgresql://{USER}@127.0.0.1:{port}/postgres"
        finally:
            proc.terminate()  # SIGTERM: a smart shutdown once clients are gone
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _wait_ready(bin_dir: Path, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {proc.returncode}: {log.read_text()}")
        ready = subprocess.run(
            [str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port), "-q"],
            check=False,
        )
        if ready.returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"postgres did not accept connections: {log.read_text()}")
