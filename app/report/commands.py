"""`gpulane explain` and `gpulane queue`: each returns an exit code."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import msgspec

from app.report.explain import explain
from app.report.live_queue import QueueView
from app.report.render import explanation_text, queue_text, runs_text
from app.store.engine import DatabaseError, is_sqlite, no_such_database, open_database


def explain_command(request_id: str, db: str, as_json: bool) -> int:
    """Explain one request from the database file, as of the log's end."""
    if is_sqlite(db) and not Path(db).is_file():
        print(f"error: {no_such_database(db)}", file=sys.stderr)
        return 1
    try:
        engine = open_database(db, upgrade=False)
    except DatabaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        story = explain(engine, request_id)
    finally:
        engine.dispose()
    if story is None:
        print(f"error: no request {request_id!r} in {db}", file=sys.stderr)
        return 1
    if as_json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(story).decode()) + "\n")
    else:
        sys.stdout.write(explanation_text(story))
    return 0


def queue_command(url: str, api_key: str | None, as_json: bool) -> int:
    """Show the live queue of the gpulane at `url` (GET /api/queue)."""
    key = api_key or os.environ.get("GPULANE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(url.rstrip("/") + "/api/queue", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        print(f"error: {url}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(
            f"error: {url}/api/queue: HTTP {response.status_code}: {response.text}", file=sys.stderr
        )
        return 1
    if as_json:
        sys.stdout.write(msgspec.json.format(response.text) + "\n")
        return 0
    view = msgspec.json.decode(response.content, type=QueueView)
    sys.stdout.write(queue_text(view))
    runs = msgspec.json.decode(response.content).get("runs") or []
    sys.stdout.write(runs_text(runs))
    return 0
