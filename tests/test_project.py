"""What the project claims is what it checks: the Python and Postgres versions it supports are
the ones CI and tox run (and the README says so), the version lives in one place, the README's
test commands are what CI runs, and the docs name no path of one particular machine.

The files are read as text (``tomllib`` is not in Python 3.10, the oldest we support)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import lonnymq
from lonnymq import migrator

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = (ROOT / "pyproject.toml").read_text()
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def claimed_pythons() -> list[tuple[int, int]]:
    """The Python versions the package claims by its classifiers, oldest first."""
    found = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', PYPROJECT)
    return sorted(_minor(v) for v in found)


def test_the_oldest_claimed_python_is_what_mypy_checks_and_requires_python_says() -> None:
    requires = re.search(r'^requires-python = ">=(3\.\d+)"', PYPROJECT, re.MULTILINE)
    mypy = re.search(r'^python_version = "(3\.\d+)"', PYPROJECT, re.MULTILINE)
    assert requires and mypy
    pythons = claimed_pythons()
    assert pythons and pythons[0] == _minor(requires[1]) == _minor(mypy[1])
    # one classifier per minor version, none skipped
    assert pythons == [(3, m) for m in range(pythons[0][1], pythons[-1][1] + 1)]


def test_every_claimed_python_has_a_tox_env_and_the_readme_names_the_untested_ones() -> None:
    tox = (ROOT / "tox.ini").read_text()
    env_list = re.search(r"^env_list = (.*)$", tox, re.MULTILINE)
    assert env_list
    envs = {e.strip() for e in env_list[1].split(",")}
    pythons = claimed_pythons()
    assert {f"py{major}{minor}" for major, minor in pythons} <= envs
    oldest, newest = (f"{m}.{n}" for m, n in (pythons[0], pythons[-1]))
    assert f"{newest[:2]}{pythons[-1][1] + 1} and later" in README  # ">=" claims them too
    # CI runs the oldest and the newest
    assert f"-e py{pythons[0][0]}{pythons[0][1]}" in CI and f"{oldest}" in README
    assert f"-e py{pythons[-1][0]}{pythons[-1][1]}" in CI


def test_ci_runs_the_core_tests_on_the_oldest_and_newest_postgres_the_readme_states() -> None:
    oldest, newest = migrator.OLDEST_SERVER, migrator.NEWEST_TESTED_SERVER
    for version in (oldest, newest):
        assert f"LONNYMQ_TEST_PG_VERSION={version} " in CI
    row = next(line for line in README.splitlines() if line.startswith("| PostgreSQL |"))
    assert f"{oldest}, 16 and {newest} (the fast subset's core modules" in row
    assert f"Older than {oldest} is refused" in row and f"newer than {newest}" in row


def test_ci_runs_the_readme_test_commands() -> None:
    for command in ('pytest -m "not slow"', "pytest  "):
        assert f"$ {command}" in README, command
    lines = [line.strip() for line in CI.splitlines()]
    assert "pytest" in lines  # the whole suite
    # the fast tests of the core modules on three Postgres versions
    assert len(re.findall(r'-- -m "not slow" "\$\{core\[@\]\}"$', CI, re.MULTILINE)) == 3


def test_the_version_lives_in_one_place() -> None:
    project = PYPROJECT.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^dynamic = \["version"\]', project, re.MULTILINE)
    assert not re.search(r"^version = ", project, re.MULTILINE)
    assert 'version = { attr = "lonnymq.__version__" }' in PYPROJECT
    assert importlib.metadata.version("lonnymq") == lonnymq.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\S+)", changelog, re.MULTILINE)
    assert releases[:2] == ["Unreleased", lonnymq.__version__], releases


#: What a path on one particular machine looks like: a home, a scratch or work directory, a
#: virtualenv's interpreter by its absolute path (``.venv/bin/activate`` is anyone's).
MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/root/|/home/\w|/tmp/|/opt/|/\S*venv\S*/bin/)")


def test_the_docs_name_no_path_of_one_machine() -> None:
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("*/README.md")]
    docs += sorted((ROOT / "docs").glob("*.md"))
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in docs
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not found, "\n".join(found)
