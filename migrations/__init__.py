"""Alembic migrations for the gpulane database (run from code by app.store.migrate)."""
