"""A throwaway PostgreSQL server on loopback, for the tests of several processes on one study.

    python3 tests/pg_server.py start DIR   # prints AUTOTUNE_TEST_POSTGRES_URL=postgresql://...
    python3 tests/pg_server.py stop DIR

.ci/run starts one this way; tests/test_distributed.py starts its own when the variable is unset
and PostgreSQL's initdb is installed (on PATH, or Debian's /usr/lib/postgresql/*/bin). PostgreSQL
refuses to run as root, so as root the server runs as the ``postgres`` user that Debian's package
creates. The password is random, and the URL carries it: the tests check that it is never printed.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

USER = "autotune"


def pg_bin() -> Path | None:
    """The folder of initdb and pg_ctl, or None when PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(candidates[-1]).parent if candidates else None


def _as_server_user(command: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *command]
    return command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(data_dir: Path | None = None) -> tuple[str, Path]:
    """Start a server; returns (its URL with the password, its data folder)."""
    binaries = pg_bin()
    if binaries is None:
        raise RuntimeError("PostgreSQL is not installed (no initdb): apt-get install postgresql")
    data_dir = Path(data_dir or tempfile.mkdtemp(prefix="autotune-pg-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(12)
    pwfile = data_dir / "pw"
    pwfile.write_text(password + "\n")
    if os.geteuid() == 0:
        shutil.chown(data_dir, "postgres", "postgres")
        shutil.chown(pwfile, "postgres", "postgres")
    pgdata = data_dir / "data"
    port = _free_port()
    try:
        subprocess.run(_as_server_user([str(binaries / "initdb"), "-D", str(pgdata), "-U", USER,
                                        f"--pwfile={pwfile}", "--auth=scram-sha-256", "-E", "UTF8"]),
                       check=True, capture_output=True, text=True)
    finally:
        pwfile.unlink()
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {data_dir} -c fsync=off -c max_connections=200"
    subprocess.run(_as_server_user([str(binaries / "pg_ctl"), "-D", str(pgdata), "-o", options,
                                    "-l", str(data_dir / "server.log"), "-w", "-t", "60", "start"]),
                   check=True, capture_output=True, text=True)
    return f"postgresql://{USER}:{password}@127.0.0.1:{port}/postgres", data_dir


def stop(data_dir: Path) -> None:
    binaries = pg_bin()
    if binaries is not None and (data_dir / "data").exists():
        subprocess.run(_as_server_user([str(binaries / "pg_ctl"), "-D", str(data_dir / "data"), "-m", "immediate",
                                        "-w", "stop"]), capture_output=True, text=True)
    shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("start", "stop"):
        sys.exit("usage: pg_server.py start|stop DIR")
    if sys.argv[1] == "start":
        url, _ = start(Path(sys.argv[2]))
        print(f"AUTOTUNE_TEST_POSTGRES_URL={url}")
    else:
        stop(Path(sys.argv[2]))
