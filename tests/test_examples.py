"""The examples run, and the README quick start is the tested example's code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _snippet(path: Path, name: str) -> str:
    text = path.read_text()
    start = f"# --8<-- [start:{name}]\n"
    end = f"# --8<-- [end:{name}]"
    body = text.split(start, 1)[1].split(end, 1)[0]
    return textwrap.dedent(body.rsplit("\n", 1)[0] + "\n")


def test_readme_quickstart_is_the_example() -> None:
    snippet = _snippet(ROOT / "examples" / "quickstart.py", "quickstart")
    assert snippet.strip() in (ROOT / "README.md").read_text()


def test_readme_celery_quickstart_is_the_demo() -> None:
    snippet = _snippet(ROOT / "examples" / "demo.py", "celery")
    assert snippet.strip() in (ROOT / "README.md").read_text()


def test_quickstart_runs(pg_dsn: str) -> None:
    env = os.environ | {"DATABASE_URL": pg_dsn}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "big-0, small-0, big-1, big-2, big-3, big-4" in out.stdout
