"""A benchmark's ratio now and at an older revision, in alternating rounds on one machine
(``python -m bench NAME --against REV``).

Some ratios swing more between runs on 2 cores than any change moves them (``consume``: the
Flight ceiling alone varies 5-13 M msg/s). Whether a figure really dropped since an older
revision is then a question for the same machine, the same hour: each round runs the
benchmark once on a copy of this tree and once on the older revision (``git archive`` of its
``src`` and ``bench``, run with this environment's packages), alternating, and the table shows
both sets of ratios. Each run measures its own baseline interleaved as usual; only the ratios
are compared — and the cost per message (every "CPU per message" figure in µs the benchmark
reports at both revisions), which does not need a baseline: a change's effect on what a
message costs the broker is one command.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import Figure, console, report

ROOT = Path(__file__).resolve().parent.parent


def tree_at(rev: str | None, into: Path) -> Path:
    """``src`` and ``bench`` of ``rev`` (None: this working tree) under ``into``."""
    into.mkdir(parents=True)
    if rev is None:
        for part in ("src", "bench"):
            shutil.copytree(ROOT / part, into / part, ignore=shutil.ignore_patterns(
                "__pycache__", "results", "*.egg-info"))
        return into
    archive = into / "tree.tar"
    try:
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), rev, "src",
                        "bench"], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"cannot read revision {rev!r}: {exc.stderr.strip()}") from None
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    archive.unlink()
    return into


def _run(tree: Path, name: str, quick: bool) -> list[dict[str, Any]]:
    """Run ``python -m bench NAME`` in ``tree`` (its own tierstream first on the path) and
    read its figures from its result file."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}"}
    cmd = [sys.executable, "-m", "bench", name, *([] if quick else ["--full"])]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    result = tree / "bench" / "results" / f"{name}.json"
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"{name} at {tree} failed: {done.stderr.strip()[-2000:]}")
    figures = json.loads(result.read_text())["figures"]
    result.unlink()
    return list(figures)


def _costs(figures: list[dict[str, Any]]) -> dict[str, float]:
    """The cost-per-message figures (µs) of one run, by name."""
    return {f["name"]: float(f["value"]) for f in figures
            if f["unit"] == "us" and "CPU per message" in f["name"]}


def _ratios(figures: list[dict[str, Any]]) -> dict[str, float]:
    """The ratios of one run's figures to their baselines (cost figures aside), by name."""
    return {f["name"]: float(f["ratio"]) for f in figures
            if f.get("ratio") is not None and not (f["unit"] == "us" and
                                                   "CPU per message" in f["name"])}


def against(name: str, rev: str, quick: bool = True, rounds: int | None = None) -> Path:
    """``name``'s ratios (each figure beside its baseline) and its cost per message, on this
    tree and at ``rev``, one run each per round, alternating which goes first. A figure is
    compared where both trees report it under the same name."""
    rounds = rounds or (4 if quick else 8)
    ours: list[float] = []
    old: list[float] = []
    ratios: dict[str, tuple[list[float], list[float]]] = {}
    costs: dict[str, tuple[list[float], list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        now_tree = tree_at(None, Path(tmp) / "now")
        old_tree = tree_at(rev, Path(tmp) / "old")
        for i in range(rounds):
            first, second = ((now_tree, 0), (old_tree, 1)) if i % 2 == 0 \
                else ((old_tree, 1), (now_tree, 0))
            for tree, side in (first, second):
                figures = _run(tree, name, quick)
                (ours, old)[side].append(float(figures[0]["ratio"]))
                for figure, ratio in _ratios(figures).items():
                    ratios.setdefault(figure, ([], []))[side].append(ratio)
                for cost, us in _costs(figures).items():
                    costs.setdefault(cost, ([], []))[side].append(us)
            console.print(f"round {i + 1}/{rounds}: this tree {ours[-1]:.2f}, {rev} "
                          f"{old[-1]:.2f}")
    figures = [Figure(f"{figure}: ratio to its baseline, this tree", "x", now,
                      f"the same at {rev}, alternating rounds", then)
               for figure, (now, then) in ratios.items() if now and len(then) == len(now)]
    figures += [Figure(f"{cost}, this tree", "us", now, f"the same at {rev}", then,
                       higher_is_better=False)
                for cost, (now, then) in costs.items() if now and len(then) == len(now)]
    return report(f"{name}-against-{rev}", figures, {"benchmark": name, "revision": rev,
                                                     "rounds": rounds, "quick": quick})
