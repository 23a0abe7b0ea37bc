"""``lonnymq metrics``: serve Prometheus metrics of the whole database (see
:mod:`lonnymq.metrics`)."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from ..dsn import mask_password
from .common import dsn_of


def cmd_metrics(args: argparse.Namespace) -> int:
    from .. import metrics

    dsn = dsn_of(args)
    try:
        server = metrics.serve(
            dsn, args.schema, port=args.port, addr=args.addr, count_ready=not args.no_count
        )
    except OSError as exc:
        raise SystemExit(f"lonnymq metrics: cannot listen on port {args.port}: {exc}") from None
    print(
        f"serving lonnymq metrics of {mask_password(dsn)} schema {args.schema!r} on "
        f"http://{args.addr}:{server.port}/metrics",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()
