"""A benchmark's ratio now and at an older revision, in alternating rounds on one machine
(``python -m bench NAME --against REV``).

Some ratios swing more between runs on 2 cores than any change moves them (``consume``: the
Flight ceiling alone varies 5-13 M msg/s). Whether a figure really dropped since an older
revision is then a question for the same machine, the same hour: each round runs the
benchmark once on a copy of this tree and once on the older revision (``git archive`` of its
``src`` and ``bench``, run with this environment's packages), alternating, and the table shows
both sets of ratios. Each run measures its own baseline interleaved as usual; only the ratios
are compared.
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

from bench.harness import Figure, console, report

ROOT = Path(__file__).resolve().parent.parent


def _tree_at(rev: str | None, into: Path) -> Path:
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


def _ratio(tree: Path, name: str, quick: bool) -> float:
    """Run ``python -m bench NAME`` in ``tree`` (its own tierstream first on the path) and
    read the first figure's ratio from its result file."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}"}
    cmd = [sys.executable, "-m", "bench", name, *([] if quick else ["--full"])]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    result = tree / "bench" / "results" / f"{name}.json"
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"{name} at {tree} failed: {done.stderr.strip()[-2000:]}")
    ratio = json.loads(result.read_text())["figures"][0]["ratio"]
    result.unlink()
    return float(ratio)


def against(name: str, rev: str, quick: bool = True, rounds: int | None = None) -> Path:
    """``name``'s first ratio (its first figure beside that figure's baseline) on this tree
    and at ``rev``, one run each per round, alternating which goes first."""
    rounds = rounds or (4 if quick else 8)
    ours: list[float] = []
    old: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        now_tree = _tree_at(None, Path(tmp) / "now")
        old_tree = _tree_at(rev, Path(tmp) / "old")
        for i in range(rounds):
            first, second = ((now_tree, ours), (old_tree, old)) if i % 2 == 0 \
                else ((old_tree, old), (now_tree, ours))
            for tree, into in (first, second):
                into.append(_ratio(tree, name, quick))
            console.print(f"round {i + 1}/{rounds}: this tree {ours[-1]:.2f}, {rev} "
                          f"{old[-1]:.2f}")
    figures = [Figure(f"{name}: first figure / its baseline, this tree", "x", ours,
                      f"the same at {rev}, alternating rounds", old)]
    return report(f"{name}-against-{rev}", figures, {"benchmark": name, "revision": rev,
                                                     "rounds": rounds, "quick": quick})
