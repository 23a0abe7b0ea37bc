"""``lonnymq web``: serve the web view (:mod:`lonnymq.web`) with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..dsn import mask_password
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
    uvicorn.run(
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
    return 0
