"""The transactional-enqueue example runs and shows rollback dropping, commit delivering."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_transactional_enqueue_example_runs(pg_dsn: str) -> None:
    env = os.environ | {"DATABASE_URL": pg_dsn}
    out = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / "transactional_enqueue.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "after rollback: orders=[]",
        "after rollback: delivered=[]",
        "after commit: orders=[2]",
        "after commit: delivered=[{'event': 'order placed', 'order_id': 2}]",
    ]
