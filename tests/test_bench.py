"""Every benchmark runs: ``python -m bench ... --tiny`` on tiny inputs, so that none can rot
unseen (``python -m bench plan`` once failed for weeks on a private method that moved)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bench.__main__ import BENCHMARKS
from bench.instructions import PATHS

from .timing import scaled

ROOT = Path(__file__).parent.parent
#: three groups run side by side: most of a tiny run is process and JVM start-up and waiting
#: for consumers to go idle, not CPU. The benchmarks on Spark share one group (one JVM); the
#: rest are split so that no group is much longer than the others
SPARK = ["spark", "sink", "schema", "compaction"]
WAITING = ["pulsar-consume", "subscriptions", "metadata", "delayed"]
GROUPS = [SPARK, WAITING, [n for n in BENCHMARKS if n not in SPARK + WAITING]]
#: and the broker's instructions per message (``--instructions``: a broker under callgrind)
COUNTED = list(PATHS) if shutil.which("valgrind") else []


@pytest.mark.slow
def test_every_benchmark_runs_on_tiny_inputs(tmp_path: Path) -> None:
    assert sorted(n for g in GROUPS for n in g) == sorted(BENCHMARKS)
    results = ROOT / "bench" / "results"
    kept = {p: p.stat().st_mtime_ns for p in results.glob("*")}  # a user's real figures
    runs = [[*names, "--tiny"] for names in GROUPS]
    runs += [[*COUNTED, "--instructions", "--tiny"]] if COUNTED else []
    # a change's effect on the count, one command: the broker at HEAD beside this tree's
    runs += [["produce", "--instructions", "--against", "HEAD", "--tiny"]] if COUNTED else []
    runs += [[*PATHS, "--flame", "--tiny"]]  # (py-spy comes with the project's dev extras)
    logs = [tmp_path / f"group-{i}.log" for i in range(len(runs))]
    procs = []
    for args, log in zip(runs, logs, strict=True):
        with log.open("w") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "bench", *args],
                                          cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=scaled(600)) for p in procs]
    for args, code, log in zip(runs, codes, logs, strict=True):
        text = log.read_text()
        assert code == 0, f"{args}:\n{text[-6000:]}"
        if "--against" in args:
            words = " ".join(text.split())  # (the console wraps long lines at 140)
            assert "broker instructions per message, this tree" in words, text[-3000:]
            assert "x the same at HEAD" in words, text[-3000:]
            continue
        if "--instructions" in args:
            assert "broker instructions per message" in text, text[-3000:]
            continue
        if "--flame" in args:
            graphs = [line.rsplit(" ", 1)[-1] for line in text.splitlines()
                      if line.startswith("flame graph of the broker")]
            assert len(graphs) == len(PATHS), text[-3000:]
            assert all(Path(g).read_text().lstrip().startswith("<?xml") for g in graphs)
            continue
        for name in args[:-1]:
            assert f"benchmark {name}: " in text, (name, text[-3000:])
    assert {p: p.stat().st_mtime_ns for p in results.glob("*")} == kept, \
        "a tiny run wrote into bench/results/"


def test_a_port_the_benchmarks_choose_is_never_an_ephemeral_one() -> None:
    """Regression: a benchmark's broker failed to start ("port already in use") on the
    --pulsar-port free_port had checked: an ephemeral port, which any outgoing connection or
    port-0 listener may take before the broker binds it. None of them may be one."""
    from bench.harness import free_port

    low, high = (int(n) for n in
                 Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(50)]
    assert not [p for p in ports if low <= p <= high], ports
    assert len(set(ports)) == len(ports)  # never the same one twice
