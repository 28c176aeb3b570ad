"""The Python examples of the README and the guide (``docs/``) run as written, against a real
broker."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from .guide import section
from .timing import scaled


def _python_block(heading: str) -> str:
    match = re.search(r"```python\n(.*?)```", section(heading), re.S)
    assert match, f"no python block after {heading!r}"
    return match.group(1)


def test_the_python_api_example_runs(broker) -> None:
    code = _python_block("## Python API")
    # The example's `...` bodies do nothing; count what the consumer received instead.
    code = code.replace("        ...                                             # one partition",
                        "        received.append(batch.num_rows)  # one partition")
    script = "received = []\n" + code + "\nassert sum(received) > 0, received\nprint('ok')\n"
    _runs_ok(script, broker.url)


def test_the_transaction_example_runs(broker) -> None:
    code = _python_block("Python writers get the same transactions")
    script = (  # the block makes its own topics, as a new user runs it
        "from tierstream.client import read\n"
        "from tierstream import Offset\n"
        + code +
        "\nn = {t: sum(b.num_rows for b in read(t, end=Offset.latest()))\n"
        "     for t in ('acme/web/orders', 'acme/web/audit')}\n"
        "assert n == {'acme/web/orders': 1001, 'acme/web/audit': 1}, n\nprint('ok')\n")
    _runs_ok(script, broker.url)


def test_the_subscriptions_example_runs(broker) -> None:
    code = _python_block("## Subscriptions")
    script = (  # the block consumes what is there; it ends once nothing came for a second
        "from tierstream import Offset\n"
        "from tierstream.client import Admin, Producer\n"
        "with Admin() as admin:\n"
        "    admin.create_topic('acme/web/orders', 2)\n"
        "with Producer('acme/web/orders') as p:\n"
        "    p.send_many({'key': f'k{i % 10}', 'value': b'o'} for i in range(500))\n"
        "from tierstream.client import Consumer\n"
        "Consumer('acme/web/orders', 'billing', mode='key_shared',\n"  # the subscription
        "         initial=Offset.earliest()).close()\n"  # exists: the block resumes it
        "handled = []\n"
        "def handle(batch):\n"
        "    handled.extend(batch.column('value').to_pylist())\n"
        + code +
        "\nassert len(handled) == 500, len(handled)\n"
        "with Admin() as admin:\n"
        "    assert sum(r['backlog'] for r in admin.subscriptions('acme/web/orders')) == 0\n"
        "print('ok')\n")
    _runs_ok(script, broker.url)


def test_the_python_sections_run_in_the_readmes_order(broker, data_dir) -> None:
    """As a reader goes on after the tour (which deletes acme/web/clicks): the Python API
    example (twice: a re-run must not fail), then the Subscriptions example, then One source
    API, whose week-long window finds the Python API example's clicks."""
    env = {"TIERSTREAM_HOME": str(data_dir)}
    api = _python_block("## Python API")
    for _ in range(2):
        _runs_ok(api + "\nprint('ok')\n", broker.url, env)
    subscriptions = _python_block("## Subscriptions")
    _runs_ok("def handle(batch):\n    pass\n" + subscriptions + "\nprint('ok')\n", broker.url,
             env)
    source = _python_block("## One source API for batch and stream")
    tail_loop = 'for batch in ts.tail("acme/web/clicks", start=cut):'
    assert tail_loop in source
    head, rest = source.split(tail_loop)
    after = rest.split("\n", 2)[2]  # the tail waits for what comes next: left out here
    _runs_ok(head + after
             + "\nassert splits and table.num_rows == 10_000, (len(splits), table.num_rows)"
             "\nassert week.num_rows == 10_000\nprint('ok')\n", broker.url, env)


def _runs_ok(script: str, url: str, env: dict[str, str] | None = None) -> None:
    """Run ``script`` as a new user would, against the broker at ``url``; it prints ok."""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=scaled(120),
                          env={**os.environ, "TIERSTREAM_BROKER": url, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
