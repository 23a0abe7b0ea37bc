"""``lonnymq web``: serve the web view (:mod:`lonnymq.web`) with uvicorn.

Before it says where it serves, it checks what would otherwise only show as error pages: that
it can log in to the database, that the schema is installed there (and that the role may read
it), and that it can listen on the host and port. Each failure exits with status 1, the
error, and what to run or change. Later on, a database that goes away gives 503 pages with
the reason, and the view recovers when it comes back.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import psycopg

from ..dsn import mask_password
from ..exceptions import PermissionDenied, SchemaError
from ..queue import Broker
from .common import dsn_of, usage_error

TOKEN_ENV = "LONNYMQ_WEB_TOKEN"


def cmd_web(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..web import create_app
        from ..web.auth import MIN_TOKEN_LENGTH
    except ImportError as exc:
        print(
            f"lonnymq: the web view needs the web extra: pip install 'lonnymq[web]' ({exc})",
            file=sys.stderr,
        )
        return 1
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if args.allow_actions and not token:
        usage_error(f"web --allow-actions needs an access token: --token or ${TOKEN_ENV}")
    if token and len(token) < MIN_TOKEN_LENGTH:
        usage_error(f"web: the access token must be at least {MIN_TOKEN_LENGTH} characters")
    dsn = dsn_of(args)
    check_database(dsn, args.schema)
    listener = listen(args.host, args.port)
    app = create_app(
        dsn,
        schema=args.schema,
        allow_actions=args.allow_actions,
        token=token if args.allow_actions else None,
        snapshot_warn_s=args.snapshot_warn,
        refresh_s=args.refresh,
    )
    audit = logging.getLogger("lonnymq.web.audit")
    audit.setLevel(logging.INFO)
    handler: logging.Handler = (
        logging.FileHandler(args.audit_log) if args.audit_log else logging.StreamHandler()
    )
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    audit.addHandler(handler)
    audit.propagate = False
    mode = "actions on (signed-in users)" if args.allow_actions else "read-only"
    if args.allow_actions and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            "lonnymq: actions are on and the view listens beyond this machine: put it behind "
            "HTTPS (a reverse proxy), or the token and session travel in clear",
            file=sys.stderr,
        )
    print(
        f"lonnymq web: schema {args.schema} of {mask_password(dsn)}, {mode}, on "
        f"http://{args.host}:{args.port}/",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=args.access_log,
        server_header=False,
        proxy_headers=args.proxy_headers,
        forwarded_allow_ips=args.forwarded_allow_ips,
        root_path=args.root_path,
    )
    with listener:
        uvicorn.Server(config).run(sockets=[listener])
    return 0


def _login_hint(error: str) -> str:
    text = error.lower()
    if "password" in text or "authentication" in text:
        return (
            "check the user and password in --dsn (or $DATABASE_URL), or PGPASSWORD and ~/.pgpass"
        )
    if "role" in text and "does not exist" in text:
        return "check the user name in --dsn (or $DATABASE_URL)"
    if "database" in text and "does not exist" in text:
        return "check the database name in --dsn (or $DATABASE_URL)"
    if "refused" in text or "could not translate host" in text or "timeout" in text:
        return "check the host and port in --dsn (or $DATABASE_URL), and that Postgres runs there"
    return "check --dsn (or $DATABASE_URL)"


def check_database(dsn: str, schema: str) -> None:
    """Exit (status 1) with the error and what to do unless the view can log in to ``dsn``
    and read the installed ``schema``."""
    shown = mask_password(dsn)
    try:
        conn = psycopg.connect(
            dsn, autocommit=True, connect_timeout=10, application_name="lonnymq-web"
        )
    except psycopg.Error as exc:
        error = mask_password(str(exc)).strip()
        raise SystemExit(
            f"lonnymq web: cannot connect to {shown}: {error}\n  {_login_hint(error)}"
        ) from None
    with conn:
        broker = Broker(schema)
        try:
            broker.check(conn)
            broker.expiring(conn)  # a read the overview makes: the role's rights
        except SchemaError as exc:
            raise SystemExit(
                f"lonnymq web: {exc}\n  run: lonnymq migrate --dsn {shown} --schema {schema}"
            ) from None
        except (PermissionDenied, psycopg.errors.InsufficientPrivilege) as exc:
            error = str(exc).splitlines()[0].split(": the database role", 1)[0]
            raise SystemExit(
                f"lonnymq web: {error}: the role {conn.info.user!r} may not read schema "
                f"{schema!r}\n  run, as the schema's owner: lonnymq grant admin "
                f"{conn.info.user} --schema {schema} --dsn ..."
            ) from None
        except psycopg.Error as exc:
            raise SystemExit(
                f"lonnymq web: cannot read schema {schema!r} of {shown}: "
                f"{mask_password(str(exc).splitlines()[0])}"
            ) from None


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` for uvicorn to serve on (bound here, so that a port
    in use is an error before the view says where it serves); exits (status 1) if it cannot."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise SystemExit(
            f"lonnymq web: cannot listen on {host}:{port}: {exc}\n  check --host"
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        what = (
            "another server listens there; pick another --port"
            if exc.errno in (98, 48)
            else "check --host and --port"
        )
        raise SystemExit(
            f"lonnymq web: cannot listen on {host}:{port}: {exc.strerror or exc}\n  {what}"
        ) from None
    return sock
