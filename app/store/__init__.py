"""Persistence: the event log (SQLite, or PostgreSQL: docs/scale-out.md) and the
read models derived from it.

tables.py        the schema (SQLAlchemy Core); Alembic in migrations/ builds it
engine.py        open_database: a path or URL; per-connection settings, startup checks,
                 upgrade to head
cursor.py        the driver's cursor on either database (placeholders, storage faults)
migrate.py       Alembic driven from code (no alembic.ini)
port.py          the EventStore contract and StoreError
event_store.py   SqlEventStore (one writer, group commit) and the reads
memory_store.py  InMemoryEventStore, the stand-in for unit tests
read_model.py    project(): what each event does to requests/processes/swaps
invariants.py    the rules `gpulane db check` enforces
commands.py      gpulane db upgrade | rebuild | check | backup | copy
log_copy.py      db copy: a whole log from one database to another
queries.py       read-model queries for the HTTP API and the CLI (activity, open jobs)
job_results.py   durable jobs: results, idempotency keys, listings
job_bodies.py    durable jobs' request bodies, stored once as bytes; the disk reserve
samples.py       recent run and load times, for estimates
explain_queries.py  the reads `explain` folds a request's story from
"""
