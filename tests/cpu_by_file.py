"""CPU seconds each test file costs, every process it starts included (brokers, Spark JVMs and
their Python workers, PostgreSQL): ``python -m tests.cpu_by_file [FILE...]`` (default: every
test file), as root. The suite on 2 cores is bound by CPU, not by waiting, so this, not a
file's wall time, says what a change to a test saves.

Each file runs alone (``pytest -m "not chaos" FILE``, one after another) in a cgroup of its
own, whose CPU account covers every descendant, also the daemons that leave their parent
(``pg_ctl``'s server). A file alone pays what it shares with others in the suite (one
SparkSession per worker, PostgreSQL per worker), so the Spark files read a little high.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V1 = Path("/sys/fs/cgroup/cpuacct")
V2 = next((p for p in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
           if (p / "cgroup.procs").exists() and (p / "cgroup.controllers").exists()), None)


def _cgroup(name: str) -> tuple[Path, Path]:
    """(directory of a new cgroup, the file whose first number is its CPU use)."""
    if (V1 / "cpuacct.usage").exists():
        group = V1 / name
        group.mkdir(exist_ok=True)
        return group, group / "cpuacct.usage"
    if V2 is not None:
        group = V2 / name
        group.mkdir(exist_ok=True)
        return group, group / "cpu.stat"
    raise SystemExit("no cgroup CPU accounting here (cgroup v1 cpuacct or v2): run as root "
                     "on Linux")


def _cpu_seconds(account: Path) -> float:
    text = account.read_text()
    if account.name == "cpuacct.usage":
        return int(text) / 1e9
    usage = next(line for line in text.splitlines() if line.startswith("usage_usec"))
    return int(usage.split()[1]) / 1e6


def measure(test_file: str) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, pytest's exit status) of ``test_file`` run alone."""
    try:
        group, account = _cgroup(f"tierstream-cpu-{os.getpid()}-{Path(test_file).stem}")
    except PermissionError:
        raise SystemExit("cannot make a cgroup here: run python -m tests.cpu_by_file as "
                         "root") from None
    try:
        before = _cpu_seconds(account)
        started = time.monotonic()
        # the shell joins the cgroup, then becomes pytest: everything it starts is counted
        code = subprocess.call(
            ["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "sh",
             sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
             "not chaos", test_file], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        wall = time.monotonic() - started
        deadline = time.monotonic() + 30
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.5)  # daemons a file left behind still count until they exit
        return _cpu_seconds(account) - before, wall, code
    finally:
        with contextlib.suppress(OSError):  # a process still in it: the group stays
            group.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="test files (default: every one)")
    files = parser.parse_args().files or sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    rows = []
    for f in files:
        cpu, wall, code = measure(f)
        rows.append((cpu, wall, code, f))
        print(f"{cpu:8.1f} CPU-s {wall:7.1f} s  {f}" + ("" if code == 0 else f"  (exit {code})"),
              flush=True)
    print(f"\n{sum(r[0] for r in rows):8.1f} CPU-s {sum(r[1] for r in rows):7.1f} s  "
          f"in {len(rows)} files; the costliest:")
    for cpu, wall, _, f in sorted(rows, reverse=True)[:15]:
        print(f"{cpu:8.1f} CPU-s {wall:7.1f} s  {f}")


if __name__ == "__main__":
    main()
