"""The guard of issue 79 §6: every command, each of its options given a wrong value (from the
commands' signatures: an option is covered the day it is added), in one process
(``every_input.py``). Each case ends in one line and exit status 1 or 2, or is taken (exit
0: a free-text option); never "unexpected", a traceback, a case that runs on, or a file
left behind; and the broker still serves afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin

from .. import forkserver
from ..timing import scaled
from .every_input import TOPIC, cases


def test_every_option_given_a_wrong_value_is_one_line_and_leaves_nothing(
        broker: BrokerProcess, tmp_path: Path) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic(TOPIC, 2)
    expected = len(list(cases()))
    assert expected > 300, expected  # every command's options, three values each
    proc = forkserver.run([sys.executable, "-m", "tests.cli.every_input", broker.url or "",
                           str(tmp_path / "cases")], capture_output=True, text=True,
                          timeout=scaled(600), cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == expected
    failures = []
    for r in results:
        err = r["stderr"].strip()
        problems = []
        if r["code"] not in (0, 1, 2):
            problems.append(f"exit {r['code']}")
        elif r["code"] and len(err.splitlines()) != 1:
            problems.append(f"{len(err.splitlines())} lines")
        if "unexpected" in err or "Traceback" in err:
            problems.append("outside the error tree")
        if r["code"] and r["left"]:
            problems.append(f"left {r['left']}")
        if problems:
            failures.append(f"tierstream {' '.join(r['argv'])}: {', '.join(problems)}: "
                            f"{err[:300]}")
    assert not failures, "\n".join(failures)
    with Admin(broker.url) as admin:  # it still serves
        assert TOPIC in {t.name for t in admin.list_topics()}
