"""Machine instructions per replayed request, counted by valgrind: a figure the
shared host's load does not move. Prints figures, asserts nothing.

    python -m bench.replay_instructions [--requests 10000] [--against REV] [--lanes]

Each figure is `valgrind --tool=callgrind` run on one simulation of the film
trace (`bench.replay_bench`'s trace and parameter sets), minus the same process
stopped before the simulation (start-up and building the trace), divided by the
requests. `--lanes` adds the same two parameter sets on groups and slots (issue
23): two GPU groups, chat on one and image + video swapping on the other, with
four chat slots (`tools/replay/whatif/film-both.yaml`), and one group of every
model (a router that allows one model at a time), and prints the ratios the
issue's targets are about. With
`--against`, the same is counted for the code at git revision REV (`git archive`
into a temporary folder), so a change is measured against the code before it in
one run. Needs valgrind (Debian's `valgrind`); about 2.5 min for 10,000 requests
on the 2-core host (2.5 more with `--against`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETS = ("none", "default", "every")
LANE_SETS = ("lanes", "lanes-every", "one-group")

# Run with the measured tree first on sys.path; it uses only what older trees
# have too, so `--against` can count code from before this file existed.
DRIVER = """
import sys
from app.core.scoring import NS_PER_S, ScoringParams
from tools.replay.generate import film
from tools.replay.simulate import Policy, simulate

requests, only = int(sys.argv[1]), sys.argv[2]
workload = film(1, days=requests // 520 + 2, limit=requests).workload
every = ScoringParams(60 * NS_PER_S, 10, fair_share_bonus=10, short_job_bonus=10)
sets = {"default": Policy(only, ScoringParams()), "every": Policy(only, every)}
if only in ("lanes", "lanes-every", "one-group"):
    from app.core.residency import Group, GroupRouter
    from tools.replay.generate import CHAT, IMAGE, VIDEO

    two = GroupRouter(
        groups=(
            Group(name="gpu0", members=(CHAT,), exclusive=False),
            Group(name="gpu1", members=(IMAGE, VIDEO), exclusive=False),
        )
    )
    one = GroupRouter(groups=(Group(name="all", members=(CHAT, IMAGE, VIDEO)),))
    slots = ((CHAT, 4),)
    sets["lanes"] = Policy(only, ScoringParams(), router=two, slots=slots)
    sets["lanes-every"] = Policy(only, every, router=two, slots=slots)
    sets["one-group"] = Policy(only, ScoringParams(), router=one)
if only in sets:
    simulate(workload, sets[only])
"""


def instructions(root: Path, requests: int, only: str) -> int:
    """What callgrind counts for the driver with the code in `root`."""
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-c",
        DRIVER,
        str(requests),
        only,
    ]
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONHASHSEED="0")
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no total:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_request(counts: dict[str, int], requests: int) -> dict[str, int]:
    return {only: (counts[only] - counts["none"]) // requests for only in counts if only != "none"}


def checkout(rev: str, into: Path) -> Path:
    tar = subprocess.run(
        ["git", "archive", rev, "app", "tools", "bench"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    return into


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--against", metavar="REV", help="also count the code at this git revision")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--lanes", action="store_true", help="also groups and slots (issue 23)")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    sets = SETS + LANE_SETS if args.lanes else SETS
    print(f"instructions per request, {args.requests:,} film requests ({' | '.join(sets[1:])})")
    rows = [("this tree", ROOT)]
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            rows.insert(0, (args.against, checkout(args.against, Path(tmp))))
        runs = [(root, only) for _, root in rows for only in sets]
        with ThreadPoolExecutor(args.jobs) as pool:  # each run is a valgrind process
            counted = list(pool.map(lambda run: instructions(run[0], args.requests, run[1]), runs))
        for n, (label, _) in enumerate(rows):
            row = counted[n * len(sets) : (n + 1) * len(sets)]
            figures = per_request(dict(zip(sets, row, strict=True)), args.requests)
            cells = " | ".join(f"{figures[only]:>8,}" for only in sets[1:])
            print(f"  {label:>12}: {cells}")
            ratios = [("every / default", "every", "default")]
            if args.lanes:
                ratios += [
                    ("lanes / default", "lanes", "default"),
                    ("lanes-every / lanes", "lanes-every", "lanes"),
                    ("lanes-every / every", "lanes-every", "every"),
                    ("one-group / default", "one-group", "default"),
                ]
            print(
                "  "
                + " " * 12
                + "  "
                + ", ".join(f"{name} {figures[a] / figures[b]:.2f}x" for name, a, b in ratios)
            )


if __name__ == "__main__":
    main()
