"""``lonnymq grant`` and ``lonnymq revoke``: database roles and their lonnymq rights."""

from __future__ import annotations

import argparse

from .. import roles
from .common import connect


def cmd_grant(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        if args.command == "grant":
            roles.grant(conn, args.kind, args.role, schema=args.schema)
            print(f"role {args.role!r} may now act as a lonnymq {args.kind} on {args.schema!r}")
        else:
            roles.revoke(conn, args.role, schema=args.schema)
            print(f"role {args.role!r} has no lonnymq rights on {args.schema!r} any more")
    return 0
