"""What Linux's /proc says about processes and TCP listeners.

Upstream management uses it to find every process an upstream started (its
group, its descendants, and those that left both but carry its environment
marker), to tell who holds a port, and to wait for processes that are not our
children. All of it is best effort: what cannot be read (another user's
process, no /proc) is unknown, never an error.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import socket
import struct
import sys
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_TCP_LISTEN = 10
_POLL_FIRST = 0.001  # where no pidfd can be had, polls back off from here...
_POLL_MAX = 0.05  # ...to here


@dataclass(frozen=True, slots=True)
class Proc:
    """One line of the process table, as /proc/PID/stat gives it."""

    pid: int
    ppid: int
    pgrp: int
    state: bytes
    start_ticks: int  # clock ticks after boot: with pid, names one process for good

    @property
    def alive(self) -> bool:
        return self.state not in (b"Z", b"X")  # a zombie holds nothing but its pid


@dataclass(frozen=True, slots=True)
class Listener:
    """A TCP socket in LISTEN state."""

    address: str  # "127.0.0.1:8080", "[::]:8080"
    inode: int
    reachable_locally: bool  # bound to a loopback or wildcard address


def stat_fields(pid: int | str) -> list[bytes] | None:
    """Fields of /proc/PID/stat after the command name: state, ppid, pgrp, ..."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def read_proc(pid: int) -> Proc | None:
    fields = stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return Proc(pid, int(fields[1]), int(fields[2]), fields[0], int(fields[19]))


def read_cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if not raw:
        return None  # a zombie, or a kernel thread
    return [os.fsdecode(arg) for arg in raw.rstrip(b"\0").split(b"\0")]


def describe(pid: int) -> str:
    """'pid N (its command line)', or 'pid N' where the command line cannot be read."""
    cmdline = read_cmdline(pid)
    return f"pid {pid}" if cmdline is None else f"pid {pid} ({' '.join(cmdline)})"


def all_procs() -> dict[int, Proc]:
    procs: dict[int, Proc] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return procs
    for entry in entries:
        if entry.isdigit():
            proc = read_proc(int(entry))
            if proc is not None:
                procs[proc.pid] = proc
    return procs


def has_marker(pid: int, marker: bytes) -> bool:
    """Whether PID's environment, as it was exec'd, holds the NAME=VALUE string MARKER."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return False
    return b"\0" + marker + b"\0" in b"\0" + environ + b"\0"


def env_entry(pid: int, prefix: bytes) -> bytes | None:
    """The first entry of PID's environment that starts with PREFIX, or None
    (none, or the environment cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return None
    return next((entry for entry in environ.split(b"\0") if entry.startswith(prefix)), None)


def marked(prefix: bytes) -> list[Proc]:
    """Live processes (this one excluded) whose environment holds an entry that
    starts with PREFIX, e.g. b"GPULANE_UPSTREAM=OWNER:"."""
    me = os.getpid()
    found = []
    for proc in all_procs().values():
        if proc.pid == me or not proc.alive:
            continue
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if (b"\0" + environ).find(b"\0" + prefix) >= 0:
            found.append(proc)
    return found


def family(root: Proc, marker: bytes | None, procs: Mapping[int, Proc]) -> list[Proc]:
    """Live processes ROOT started, ROOT excluded: members of the group it leads,
    processes whose environment holds MARKER (a daemon that forked twice and
    called setsid keeps that and nothing else), and the descendants of all these.

    Only processes born since ROOT count: a reused pid's children are not ours."""
    me = os.getpid()
    young = [p for p in procs.values() if p.start_ticks >= root.start_ticks and p.pid != me]
    children: defaultdict[int, list[Proc]] = defaultdict(list)
    for proc in young:
        children[proc.ppid].append(proc)
    found = {
        proc.pid: proc
        for proc in young
        if proc.pid != root.pid
        and (proc.pgrp == root.pid or (marker is not None and has_marker(proc.pid, marker)))
    }
    stack = [root.pid, *found]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child.pid not in found and child.pid != root.pid:
                found[child.pid] = child
                stack.append(child.pid)
    return [proc for proc in found.values() if proc.alive]


def descendants(root: Proc) -> list[Proc] | None:
    """ROOT's live descendants from the kernel's per-thread children lists: no
    scan of every process. None where the kernel keeps no such lists."""
    found: dict[int, Proc] = {}
    stack = [root.pid]
    while stack:
        pid = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone meanwhile
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                    children = f.read().split()
            except FileNotFoundError:
                if pid == root.pid and task == str(pid):
                    return None  # no CONFIG_PROC_CHILDREN
                continue
            except OSError:
                continue
            for child in map(int, children):
                proc = read_proc(child)
                if proc is not None and child not in found and proc.start_ticks >= root.start_ticks:
                    found[child] = proc
                    stack.append(child)
    return [proc for proc in found.values() if proc.alive]


def tcp_listeners(port: int) -> list[Listener] | None:
    """Sockets listening on PORT in this network namespace; None when neither the
    kernel's socket-diagnostics interface nor /proc/net can be read."""
    try:
        return _diag_listeners(port)
    except OSError:
        return _proc_net_listeners(port)


def _diag_listeners(port: int) -> list[Listener]:
    # What `ss -lt` asks: listening sockets only, so its cost does not grow with
    # the TIME_WAIT sockets that make /proc/net/tcp slow (10 ms at 1,000).
    found = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        for family in (socket.AF_INET, socket.AF_INET6):
            # inet_diag_req_v2: family, protocol, ext, pad, states; sockid (sport first)
            request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN)
            request += struct.pack(">H", port) + bytes(46)
            flags = _NLM_F_REQUEST | _NLM_F_DUMP
            nl.send(
                struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, flags, 1, 0)
                + request
            )
            for msg in _netlink_replies(nl):
                # inet_diag_msg: family, state, timer, retrans, sockid, 4 x u32, uid, inode
                (sport,) = struct.unpack_from(">H", msg, 4)
                if msg[1] != _TCP_LISTEN or sport != port:
                    continue  # older kernels do not filter a dump by port
                raw = msg[8:24] if family == socket.AF_INET6 else msg[8:12]
                (inode,) = struct.unpack_from("=I", msg, 68)
                found.append(_listener(ipaddress.ip_address(raw), port, inode))
    return found


def _netlink_replies(nl: socket.socket) -> Iterator[bytes]:
    while True:
        data = nl.recv(65536)
        offset = 0
        while offset + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, offset)
            if kind == _NLMSG_DONE:
                return
            if kind == _NLMSG_ERROR:
                (error,) = struct.unpack_from("=i", data, offset + 16)
                raise OSError(-error, os.strerror(-error))
            yield data[offset + 16 : offset + length]
            offset += (length + 3) & ~3


def _proc_net_listeners(port: int) -> list[Listener] | None:
    found: list[Listener] | None = None
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below; a missing file is skipped
        except OSError:
            continue
        found = found or []
        with f:
            next(f, None)  # the header
            for line in f:
                parts = line.split()
                if len(parts) < 10 or parts[3] != b"0A":  # 0A: LISTEN
                    continue
                hex_addr, _, hex_port = parts[1].partition(b":")
                if int(hex_port, 16) == port:
                    found.append(_listener(_address(hex_addr, v6), port, int(parts[9])))
    return found


def _listener(
    addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, inode: int
) -> Listener:
    text = f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return Listener(text, inode, addr.is_loopback or addr.is_unspecified)


def socket_holders(inodes: Collection[int], pids: Iterable[int]) -> dict[int, list[int]]:
    """For each socket inode, the pids among PIDS with it open (their fd tables readable)."""
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    holders: dict[int, list[int]] = {}
    if not wanted:
        return holders
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                inode = wanted.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
            if inode is not None and pid not in holders.setdefault(inode, []):
                holders[inode].append(pid)
    return holders


def all_pids() -> list[int]:
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []


def signal_procs(procs: Iterable[Proc], sig: signal.Signals) -> None:
    """Sends SIG to each of PROCS that still is the process the snapshot saw."""
    for proc in procs:
        now = read_proc(proc.pid)
        if now is None or now.start_ticks != proc.start_ticks or not now.alive:
            continue  # gone, or the pid names another process now
        try:
            os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


async def wait_gone(procs: Sequence[Proc], timeout: float) -> list[Proc]:
    """Waits until each of PROCS has exited or TIMEOUT seconds pass; returns those left.

    Not our children, so no exit notice comes through a subprocess protocol: a
    pidfd becomes readable at exit; where none can be opened, poll."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    waits: dict[asyncio.Future[None], tuple[Proc, int]] = {}
    polled: list[Proc] = []
    try:
        for proc in procs:
            try:
                fd = os.pidfd_open(proc.pid)
            except ProcessLookupError:
                continue
            except (OSError, AttributeError):
                polled.append(proc)
                continue
            if not _same_live(proc):  # checked after opening: the fd now pins the process
                os.close(fd)
                continue
            future: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _resolve, future)
            waits[future] = (proc, fd)
        if waits:
            await asyncio.wait(waits, timeout=timeout)
        pause = _POLL_FIRST
        while polled and loop.time() < deadline:
            polled = [p for p in polled if _same_live(p)]
            if polled:
                await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
                pause = min(pause * 2, _POLL_MAX)
        left = [proc for future, (proc, _) in waits.items() if not future.done()]
        return left + [p for p in polled if _same_live(p)]
    finally:
        for _, fd in waits.values():
            loop.remove_reader(fd)
            os.close(fd)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _same_live(proc: Proc) -> bool:
    now = read_proc(proc.pid)
    return now is not None and now.start_ticks == proc.start_ticks and now.alive


def _address(hex_addr: bytes, v6: bool) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr.decode())
    # The kernel prints each 32-bit word of the address in host byte order.
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    words = raw
    return ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words)
