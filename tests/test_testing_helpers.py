"""lonnymq.testing, which the examples and the demo use: its errors name the variable to set."""

from __future__ import annotations

import pytest

from lonnymq import testing


def test_no_server_binaries_names_the_variable_the_caller_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("LONNYMQ_TEST_DSN", raising=False)
    monkeypatch.setattr(testing, "_candidates", lambda: [])
    monkeypatch.setattr(testing, "_bundled_bindirs", lambda: [])
    with pytest.raises(testing.NoServerBinaries) as err, testing.database():
        pass
    assert "set DATABASE_URL" in str(err.value) and "LONNYMQ_TEST_DSN" not in str(err.value)
    with (
        pytest.raises(testing.NoServerBinaries, match="set LONNYMQ_TEST_DSN"),
        testing.database("LONNYMQ_TEST_DSN"),
    ):
        pass


def test_where_says_which_postgres(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:secret@db:5432/app")
    shown = testing.where("postgresql://u:secret@db:5432/app")
    assert shown == "Postgres: postgresql://u:**@db:5432/app (from $DATABASE_URL)"
    monkeypatch.delenv("DATABASE_URL")
    assert "throwaway" in testing.where("postgresql://postgres@127.0.0.1:5999/postgres")
