"""sqlite3's placeholders as psycopg's: the writer's statements are written once."""

from __future__ import annotations

import pytest

from app.store.cursor import to_psycopg


@pytest.mark.parametrize(
    ("sqlite", "psycopg"),
    [
        (
            "UPDATE requests SET score = ? WHERE id = ?",
            "UPDATE requests SET score = %s WHERE id = %s",
        ),
        (
            "UPDATE requests SET attempt = :attempt WHERE id = :id",
            "UPDATE requests SET attempt = %(attempt)s WHERE id = %(id)s",
        ),
        # Inside a string nothing is a placeholder; a % is doubled wherever it is.
        (
            "SELECT '?', ':x', 'a%b' WHERE x LIKE '%' || ?",
            "SELECT '?', ':x', 'a%%b' WHERE x LIKE '%%' || %s",
        ),
        ("SELECT 'it''s :x ?' = :y", "SELECT 'it''s :x ?' = %(y)s"),
        # PostgreSQL's cast is not a name.
        (
            "SELECT data::json ->> 'k' FROM events WHERE seq = :seq",
            "SELECT data::json ->> 'k' FROM events WHERE seq = %(seq)s",
        ),
        ("SELECT 5 % 2", "SELECT 5 %% 2"),
    ],
)
def test_placeholders_are_rewritten_outside_strings_only(sqlite: str, psycopg: str) -> None:
    assert to_psycopg(sqlite) == psycopg
