"""The server lease: one log, one server.

Which gpulane serves a database is one row of `server_lease` (name `leader`):
its term, who holds it (pid, host, listen address) and until when. A server
takes it before it touches anything (before recovery), renews it while it
serves, and expires it when it stops cleanly; the term stays.

- `acquire` runs in one write transaction. It takes the lease when there is no
  row, when the lease has expired (`expires_at <= now`: released, or not
  renewed for LEASE_TTL_S), or when its holder is a process on this host that no
  longer exists (a killed server never blocks a restart); the term goes up by
  one. Otherwise it raises `LeaseHeld`, naming the holder and what to do.
- `renew` and `release` are scoped to the term (`WHERE term = :mine`): a holder
  whose term has passed (another took over) gets `LeaseLost` and must write
  nothing more.
- `holds` tells, inside any transaction, whether a term is still the lease's,
  for writes that must be fenced.

Every statement is SQLAlchemy Core and portable. The row is read `FOR UPDATE`
(PostgreSQL locks it; SQLite has no such clause and relies on BEGIN IMMEDIATE,
which the engine issues for `sqlite_begin="IMMEDIATE"`); two servers inserting
the first row at once collide on the primary key, and the loser reads again.
Times are unix seconds (REAL), as in every other table.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import sqlalchemy
from sqlalchemy import Connection, insert, select, update
from sqlalchemy.engine import Engine

from app.config.raw import DEFAULT_LEASE_SECONDS
from app.core import events as ev
from app.store.cursor import driver_cursor
from app.store.engine import DatabaseError, describe
from app.store.tables import server_lease

NAME: Final = "leader"
"""The one row's name."""

LEASE_TTL_S: Final = DEFAULT_LEASE_SECONDS
"""How long a lease lasts without renewal (`database.leaseSeconds`'s default). A
server that stops renewing (hung, stopped, or its database unwritable) can be
taken over this long after its last renewal; a killed one at once, from the
same host."""

RENEW_EVERY_S: Final = LEASE_TTL_S / 3
"""How often a serving gpulane renews its lease: three tries per TTL."""

_PROC: Final = Path("/proc")

HOST_VAR: Final = "GPULANE_HOST"
"""Environment variable naming this gpulane's host in the lease, instead of its
host name: fronts on machines that share a host name (containers on the host's
network, cloned images) must not take each other for a process on their own
host, whose pid they could look up."""


def host_name() -> str:
    """This host as the lease names it: `GPULANE_HOST`, else the host name."""
    return os.environ.get(HOST_VAR) or socket.gethostname()


class LeaseHeld(DatabaseError):
    """Another live gpulane holds the lease; the message names it and what to do."""

    def __init__(self, message: str, row: LeaseRow | None = None) -> None:
        super().__init__(message)
        self.row = row
        """The lease as it was read: who holds it, until when."""


class LeaseLost(Exception):
    """The term is no longer the lease's: another server took over. The holder of
    the old term must write nothing more."""


@dataclass(frozen=True)
class Holder:
    """A server that holds, or asks for, the lease."""

    pid: int
    host: str
    listen: str
    name: str
    """Unique to this process serving this database (`holder_name`)."""


@dataclass(frozen=True)
class LeaseRow:
    term: int
    holder: str
    pid: int
    host: str
    listen: str
    acquired_at: float
    renewed_at: float
    expires_at: float

    @property
    def released(self) -> bool:
        """Expired by its holder on a clean stop (a renewal always leaves
        `expires_at` a TTL after `renewed_at`)."""
        return self.expires_at <= self.renewed_at


@dataclass(frozen=True)
class Lease:
    """The lease as its holder took it."""

    term: int
    holder: Holder
    acquired_at: float
    expires_at: float
    previous: LeaseRow | None = None
    """The row taken over; None for a database never served before."""
    previous_ended: ev.LeaseEnd | None = None

    def event(self, at: int) -> ev.LeaseAcquired:
        """The `lease_acquired` that records this acquisition in the log."""
        prev = self.previous
        return ev.LeaseAcquired(
            at=at,
            term=self.term,
            pid=self.holder.pid,
            host=self.holder.host,
            listen=self.holder.listen,
            previous_pid=None if prev is None else prev.pid,
            previous_host=None if prev is None else prev.host,
            previous_listen=None if prev is None else prev.listen,
            previous_ended=self.previous_ended,
        )


# -- who holds it -------------------------------------------------------------


def this_process(engine: Engine, listen: str) -> Holder:
    """The holder this gpulane process is, serving `engine`'s database on `listen`."""
    pid = os.getpid()
    host = host_name()
    name = holder_name(host, pid, process_start(pid), database_id(engine))
    return Holder(pid, host, listen, name)


def holder_name(host: str, pid: int, start: str | None, database: str) -> str:
    """`HOST:PID:START:DATABASE`. START tells this process from a later one that
    reuses its pid; DATABASE tells the file it serves from a copy of it (a backup
    copied with its lease row names the server of the original)."""
    return f"{host}:{pid}:{start or '-'}:{database}"


def database_id(engine: Engine) -> str:
    """The database file's device and inode (`DEV.INODE`); `''` for a server database."""
    path = engine.url.database
    if engine.dialect.name != "sqlite" or not path:
        return ""
    try:
        stat = os.stat(path)
    except OSError:
        return ""
    return f"{stat.st_dev}.{stat.st_ino}"


def process_start(pid: int) -> str | None:
    """When PID started, as `BOOT_ID/TICKS` (`/proc`); None where there is no
    `/proc` (then a pid alone tells who holds the lease) or PID is not there."""
    try:
        stat = (_PROC / str(pid) / "stat").read_bytes()
        boot = (_PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return None
    # Field 22 (starttime), counted after the command name, which may hold spaces.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return f"{boot}/{fields[19].decode()}"


def holder_alive(row: LeaseRow, database: str) -> bool | None:
    """Whether the process that holds `row` still runs and serves this database.

    None for a holder on another host (only the lease's expiry tells). False
    when its pid is gone, a zombie, or now another process (its start differs),
    or when it serves another file (`row` was copied with this one).
    """
    if row.host != host_name():
        return None
    try:
        os.kill(row.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    if not (_PROC / "self").is_dir():
        return True  # no /proc: the pid is all there is to go on
    try:
        stat = (_PROC / str(row.pid) / "stat").read_bytes()
    except OSError:
        # Gone meanwhile; or hidden (hidepid): then it is alive, as os.kill said.
        return (_PROC / str(row.pid)).exists()
    if stat[stat.rfind(b")") + 2 :][:1] in (b"Z", b"X"):
        return False  # killed, not yet reaped
    return holder_name(row.host, row.pid, process_start(row.pid), database) == row.holder


# -- the statements -----------------------------------------------------------


def read(conn: Connection, *, lock: bool = False) -> LeaseRow | None:
    """The lease row, if any (`lock`: FOR UPDATE, inside a write transaction)."""
    query = select(
        server_lease.c.term,
        server_lease.c.holder,
        server_lease.c.pid,
        server_lease.c.host,
        server_lease.c.listen,
        server_lease.c.acquired_at,
        server_lease.c.renewed_at,
        server_lease.c.expires_at,
    ).where(server_lease.c.name == NAME)
    if lock:
        query = query.with_for_update()
    row = conn.execute(query).first()
    return None if row is None else LeaseRow(*row)


def peek(engine: Engine) -> LeaseRow | None:
    """The lease row read without a write lock (what a standby polls)."""
    with engine.connect() as conn:
        return read(conn)


def ended_by(
    row: LeaseRow, now: float, alive: Callable[[LeaseRow], bool | None]
) -> ev.LeaseEnd | None:
    """How `row`'s term has ended by `now`, so that another may take the lease;
    None while it is live."""
    if row.expires_at <= now:
        return "released" if row.released else "expired"
    if alive(row) is False:
        return "gone"
    return None


def holds(conn: Connection, term: int) -> bool:
    """Whether `term` is still the lease's term, read in `conn`'s transaction: a
    write that checks it in the transaction that writes is fenced."""
    # Plain SQL on the driver's cursor: this runs in every write transaction of
    # the event store, where SQLAlchemy's compile of a select cost a fifth of a commit.
    cur = driver_cursor(conn)
    try:
        found = cur.execute(_TERM, (NAME,)).fetchone()
    finally:
        cur.close()
    return found is not None and found[0] == term


_TERM = "SELECT term FROM server_lease WHERE name = ?"


def fence(term: int, conn: Connection) -> None:
    """The event store's fence: raise LeaseLost unless `term` still holds the lease."""
    if not holds(conn, term):
        raise LeaseLost(
            f"the lease of term {term} is lost: another gpulane took this database over"
        )


def acquire(
    engine: Engine,
    holder: Holder,
    now: float,
    *,
    ttl: float = LEASE_TTL_S,
    alive: Callable[[LeaseRow], bool | None] | None = None,
) -> Lease:
    """Take the lease for `holder`, in one write transaction, or raise `LeaseHeld`.

    `alive` says whether a row's holder still runs (default `holder_alive` for
    this database). Raises `DatabaseError` when the database cannot be used.
    """
    database = database_id(engine)

    def here(row: LeaseRow) -> bool | None:
        return holder_alive(row, database)

    for attempt in range(2):
        try:
            with _writing(engine) as conn:
                return _acquire(conn, holder, now, ttl, alive or here, engine)
        except sqlalchemy.exc.IntegrityError as exc:
            # Another server inserted the first row since we read none: read it again.
            if attempt:
                raise DatabaseError(
                    _where(engine) + f"cannot take the lease ({describe(exc)})"
                ) from exc
        except sqlalchemy.exc.SQLAlchemyError as exc:
            raise DatabaseError(
                _where(engine) + f"cannot take the lease ({describe(exc)})"
            ) from exc
    raise AssertionError("unreachable")


def _acquire(
    conn: Connection,
    holder: Holder,
    now: float,
    ttl: float,
    alive: Callable[[LeaseRow], bool | None],
    engine: Engine,
) -> Lease:
    values = {
        "holder": holder.name,
        "pid": holder.pid,
        "host": holder.host,
        "listen": holder.listen,
        "acquired_at": now,
        "renewed_at": now,
        "expires_at": now + ttl,
    }
    row = read(conn, lock=True)
    if row is None:
        conn.execute(insert(server_lease).values(name=NAME, term=1, **values))
        return Lease(term=1, holder=holder, acquired_at=now, expires_at=now + ttl)
    ended = ended_by(row, now, alive)
    if ended is None:
        raise LeaseHeld(_where(engine) + held_message(row, now, ttl), row)
    term = row.term + 1
    taken = conn.execute(
        update(server_lease)
        .where(server_lease.c.name == NAME, server_lease.c.term == row.term)
        .values(term=term, **values)
    )
    if taken.rowcount != 1:  # only where the row lock was not honoured
        raise LeaseHeld(_where(engine) + "another gpulane took the lease at the same moment")
    return Lease(
        term=term,
        holder=holder,
        acquired_at=now,
        expires_at=now + ttl,
        previous=row,
        previous_ended=ended,
    )


def renew(engine: Engine, lease: Lease, now: float, *, ttl: float = LEASE_TTL_S) -> Lease:
    """Extend the lease to `now + ttl` if its term is still `lease.term`, else raise
    `LeaseLost` naming the server that took over. Raises SQLAlchemy's errors when
    the database cannot be written (the lease then runs on until it expires)."""
    with _writing(engine) as conn:
        renewed = conn.execute(
            update(server_lease)
            .where(server_lease.c.name == NAME, server_lease.c.term == lease.term)
            .values(renewed_at=now, expires_at=now + ttl)
        )
        if renewed.rowcount != 1:
            raise LeaseLost(lost_message(lease, read(conn)))
    return Lease(
        term=lease.term,
        holder=lease.holder,
        acquired_at=lease.acquired_at,
        expires_at=now + ttl,
        previous=lease.previous,
        previous_ended=lease.previous_ended,
    )


def release(engine: Engine, lease: Lease, now: float) -> bool:
    """Expire the lease now (a clean stop), keeping its term; False when the term
    had already passed (nothing is changed then)."""
    with _writing(engine) as conn:
        released = conn.execute(
            update(server_lease)
            .where(server_lease.c.name == NAME, server_lease.c.term == lease.term)
            .values(renewed_at=now, expires_at=now)
        )
        return bool(released.rowcount == 1)


# -- messages -----------------------------------------------------------------


def held_message(row: LeaseRow, now: float, ttl: float = LEASE_TTL_S) -> str:
    """Why a second server refuses to start, and what to do."""
    here = row.host == host_name()
    where = f"host {row.host}" + (" (this host)" if here else "")
    stop = f"`kill {row.pid}`" + ("" if here else f" on {row.host}")
    return (
        f"another gpulane serves this database: pid {row.pid} on {where}, listening on "
        f"{row.listen} (lease term {row.term}, renewed {max(0.0, now - row.renewed_at):.0f} s "
        f"ago). One database has one server: send requests to {row.listen}, or stop "
        f"that server first ({stop}, or its service manager) and start this one again; "
        f"to keep this one waiting to take over, start it with --standby; to run a "
        f"second server, give it its own database (--db). A killed server does not "
        f"block a restart, and a lease not renewed for {ttl:g} s lapses."
    )


def lost_message(lease: Lease, row: LeaseRow | None) -> str:
    if row is None:
        return f"the server lease (term {lease.term}) was deleted from the database"
    return (
        f"another gpulane took over this database: pid {row.pid} on {row.host}, listening "
        f"on {row.listen}, term {row.term} (this server held term {lease.term})"
    )


def _where(engine: Engine) -> str:
    return f"{engine.url.database or engine.url.render_as_string()}: "


@contextmanager
def _writing(engine: Engine) -> Iterator[Connection]:
    """A write transaction: BEGIN IMMEDIATE on SQLite (the lock up front), a plain
    BEGIN elsewhere."""
    with engine.connect() as conn:
        conn.execution_options(sqlite_begin="IMMEDIATE")
        with conn.begin():
            yield conn
