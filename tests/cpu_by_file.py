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
import tempfile
import time
from pathlib import Path
from typing import Any

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


ACCOUNT_ENV = "TIERSTREAM_CPU_ACCOUNT"
PER_TEST_ENV = "TIERSTREAM_CPU_PER_TEST"


def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    """As a pytest plugin (``-p tests.cpu_by_file``, which ``--per-test`` adds): append each
    test's CPU seconds, read from the cgroup account around it, to the file named in
    ``TIERSTREAM_CPU_PER_TEST``."""
    account, out = os.environ.get(ACCOUNT_ENV), os.environ.get(PER_TEST_ENV)
    if not account or not out:
        return None
    before = _cpu_seconds(Path(account))
    started = time.monotonic()
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    from _pytest.runner import runtestprotocol
    runtestprotocol(item, nextitem=nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    with open(out, "a") as f:
        f.write(f"{_cpu_seconds(Path(account)) - before:.2f}\t"
                f"{time.monotonic() - started:.1f}\t{item.nodeid}\n")
    return True


def measure(test_file: str, per_test: Path | None = None) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, pytest's exit status) of ``test_file`` run alone; with
    ``per_test``, each test's CPU seconds are appended to that file."""
    try:
        group, account = _cgroup(f"tierstream-cpu-{os.getpid()}-{Path(test_file).stem}")
    except PermissionError:
        raise SystemExit("cannot make a cgroup here: run python -m tests.cpu_by_file as "
                         "root") from None
    try:
        before = _cpu_seconds(account)
        started = time.monotonic()
        # the shell joins the cgroup, then becomes pytest: everything it starts is counted
        plugin = ["-p", "tests.cpu_by_file"] if per_test else []
        env = {**os.environ, ACCOUNT_ENV: str(account), PER_TEST_ENV: str(per_test or "")}
        code = subprocess.call(
            ["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "sh",
             sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, "-m",
             "not chaos", test_file], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env=env)
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
    parser.add_argument("--per-test", action="store_true",
                        help="also each test's CPU seconds, the costliest 30")
    args = parser.parse_args()
    files = args.files or sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    per_test = Path(tempfile.mkstemp(prefix="tierstream-cpu-", suffix=".tsv")[1]) \
        if args.per_test else None
    rows = []
    for f in files:
        cpu, wall, code = measure(f, per_test)
        rows.append((cpu, wall, code, f))
        print(f"{cpu:8.1f} CPU-s {wall:7.1f} s  {f}" + ("" if code == 0 else f"  (exit {code})"),
              flush=True)
    print(f"\n{sum(r[0] for r in rows):8.1f} CPU-s {sum(r[1] for r in rows):7.1f} s  "
          f"in {len(rows)} files; the costliest:")
    for cpu, wall, _, f in sorted(rows, reverse=True)[:15]:
        print(f"{cpu:8.1f} CPU-s {wall:7.1f} s  {f}")
    if per_test is not None:
        tests = [line.split("\t") for line in per_test.read_text().splitlines()]
        per_test.unlink()
        print("\nthe costliest tests:")
        for cpu_s, wall_s, node in sorted(tests, key=lambda t: -float(t[0]))[:30]:
            print(f"{float(cpu_s):8.1f} CPU-s {float(wall_s):7.1f} s  {node}")


if __name__ == "__main__":
    main()
