"""Durable jobs and the Batch API as a service: no HTTP here (docs/jobs.md).

The service owns what a job or a batch is, whichever door it came through:
idempotency and body storage (`durable.py`), the disk reserve (`reserve.py`),
a batch's lifecycle and its watcher (`batches.py`, `batch_files.py`), its
progress (`batch_progress.py`) and the reading of its input (`batch_input.py`);
and chains, requests a caller names as one run (`chain_index.py`, the chains
the log names; `chain_progress.py`, their progress by the batches' estimator).
It talks to the run loop through the scheduler's public methods and to the
upstreams through `durable.Upstream`; what it refuses is a domain error
(`errors.py`) that app/web maps to HTTP in one place (app/web/errors.py).
"""
