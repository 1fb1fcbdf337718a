"""What the jobs service refuses: domain errors, mapped to HTTP by app/web/errors.py."""

from __future__ import annotations


class JobsError(Exception):
    """A refusal for the caller: `code` names it, `param` the field at fault,
    `recorded_as` the id of its `request_rejected` where the service recorded it
    (else the door does: app/web/refusals.py)."""

    def __init__(
        self, message: str, code: str, param: str | None = None, *, recorded_as: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.recorded_as = recorded_as


class Invalid(JobsError):
    """The request is not one the service can run (a bad field, a wrong file)."""


class NotFound(JobsError):
    """No such job, batch or file, or not the caller's to see."""


class Conflict(JobsError):
    """Not possible in the state it is in (an ended job, a reused key)."""


class Unavailable(JobsError):
    """The event log refused a write: nothing was accepted; send it again."""


class NoSpace(JobsError):
    """Storing it would break jobs.minFreeDisk, or the disk filled up."""


class HeaderTooLarge(JobsError):
    """A header the job would store is over its limit (app/jobs/stored_bytes.py)."""


class OverCap(JobsError):
    """The caller's open durable jobs hold jobs.maxStoredBytesPerCaller already."""
