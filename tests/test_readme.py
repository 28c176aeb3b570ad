"""The README's Python example runs as written, against a real broker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .timing import scaled

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
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


def _runs_ok(script: str, url: str) -> None:
    """Run ``script`` as a new user would, against the broker at ``url``; it prints ok."""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=scaled(120), env={**os.environ, "TIERSTREAM_BROKER": url})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
