"""A real PostgreSQL server for the tests: ``initdb`` and ``pg_ctl`` (PostgreSQL 15 on these
machines) into a temporary directory, listening on a free loopback port, run as the
``postgres`` user when the tests run as root (``initdb`` refuses root). One server per test
session (per xdist worker); each test gets a database of its own.

A test that needs it and cannot start it fails with one line saying why: nothing is skipped.
``python -m bench metadata`` starts one the same way.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .ports import fixed_port
from .timing import scaled

__all__ = ["PostgresServer", "PostgresUnavailable", "postgres_server", "started", "started_on"]


class PostgresUnavailable(Exception):
    """PostgreSQL could not be started here (the reason in one line)."""


class PostgresServer:
    def __init__(self, *, fsync: bool = False, also_on: str | None = None) -> None:
        """``fsync``: off for tests (nothing here survives a power cut anyway); on for the
        benchmark, where the engine's real cost is the figure. ``also_on``: another address
        to listen on (a bridge to network namespaces), trusted as loopback is."""
        self.fsync = fsync
        self.also_on = also_on
        initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise PostgresUnavailable("PostgreSQL's initdb and pg_ctl are not on PATH: install "
                                      "PostgreSQL (the metadata tests need a real server)")
        self.pg_ctl = pg_ctl
        self.root = Path(tempfile.mkdtemp(prefix="tierstream-pg-"))
        self.data = self.root / "data"
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root: run the server as postgres
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable("running as root and there is no 'postgres' user "
                                          "to run PostgreSQL as") from None
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.port = fixed_port()  # resume() starts it on this port again (ports.py)
        self._run([initdb, "-D", str(self.data), "-U", "postgres", "-A", "trust",
                   "--no-sync", "-E", "UTF8"], "initdb")
        # one role checks its password (the rest is trusted: loopback, test data only)
        hba = self.data / "pg_hba.conf"
        extra = f"host all all {also_on}/24 trust\n" if also_on else ""
        hba.write_text("host all secured 127.0.0.1/32 scram-sha-256\n" + hba.read_text()
                       + extra)
        self.resume()
        self._names = itertools.count()
        self.sql(self.url(), "CREATE ROLE secured LOGIN SUPERUSER PASSWORD 's3cret'")

    def resume(self) -> None:
        """Start the server (again, after :meth:`halt`), on the same port and data."""
        self._run([self.pg_ctl, "-D", str(self.data), "-l", str(self.root / "log"), "-w",
                   "-t", str(int(scaled(60))), "-o",
                   f"-p {self.port} -k {self.root} -c listen_addresses="
                   f"127.0.0.1{',' + self.also_on if self.also_on else ''} "
                   f"-c fsync={'on' if self.fsync else 'off'} -c max_connections=200",
                   "start"], "pg_ctl start")

    def halt(self) -> None:
        """Stop the server (fast shutdown: its sessions are ended), keeping its data."""
        self._run([self.pg_ctl, "-D", str(self.data), "-m", "fast", "-w", "stop"],
                  "pg_ctl stop")

    def _run(self, cmd: list[str], what: str) -> None:
        done = subprocess.run([*self.as_user, *cmd], capture_output=True, text=True,
                              timeout=scaled(120))
        if done.returncode != 0:
            log = self.root / "log"
            tail = log.read_text()[-1500:] if log.exists() else ""
            raise PostgresUnavailable(
                f"cannot start PostgreSQL ({what} exited {done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-800:]} {tail}")

    def url(self, database: str = "postgres", user: str = "postgres",
            host: str = "127.0.0.1") -> str:
        return f"postgresql://{user}@{host}:{self.port}/{database}"

    def new_database(self) -> str:
        """The URL of a new, empty database."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True,
                             connect_timeout=int(scaled(30))) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def sql(self, url: str, statement: str) -> None:
        import psycopg

        with psycopg.connect(url, autocommit=True, connect_timeout=int(scaled(30))) as conn:
            conn.execute(statement)

    def stop(self) -> None:
        subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.data), "-m", "immediate",
                        "stop"], capture_output=True, timeout=scaled(60))
        shutil.rmtree(self.root, ignore_errors=True)


def started() -> PostgresServer:
    """A new server, or the test fails with the one line saying why."""
    import pytest

    try:
        return PostgresServer()
    except PostgresUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


def started_on(address: str) -> PostgresServer:
    """A new server also listening on ``address`` (network namespaces reach it there)."""
    import pytest

    try:
        return PostgresServer(also_on=address)
    except PostgresUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


def postgres_server() -> Iterator[PostgresServer]:
    server = started()
    try:
        yield server
    finally:
        server.stop()
