"""Every code block of the README and the user guide (``docs/``) is checked: Python blocks
parse, every ``tierstream`` command line names a command and options that exist, and the
README's Python read runs against a real broker. (The longer examples run in
``test_readme.py``, the tour in ``test_tour.py``, the Pulsar example in
``pulsar_wire/test_pulsar_produce.py``.)"""

from __future__ import annotations

import ast
import re
import shlex

import typer

from tierstream.broker.process import BrokerProcess
from tierstream.cli import app
from tierstream.client import Admin, Producer

from .cli.every_help import commands
from .guide import blocks, pages, section
from .test_readme import _runs_ok


def test_every_python_block_parses() -> None:
    found = blocks("python")
    assert len(found) > 15, len(found)
    for page, code in found:
        try:
            ast.parse(code)
        except SyntaxError as exc:
            raise AssertionError(f"{page.name}: {exc}\n{code}") from None


def _command_lines(code: str) -> list[str]:
    """The ``tierstream ...`` command lines of a bash block, continuation lines joined and
    comments dropped."""
    lines, current = [], ""
    for line in code.splitlines():
        text = re.sub(r"\s+#.*$", "", line).rstrip()
        if text.endswith("\\"):
            current += text[:-1] + " "
            continue
        current += text.strip()
        for part in re.split(r"\s*(?:\||&&|;)\s*", current):
            if part.startswith("tierstream "):
                lines.append(part)
        current = ""
    return lines


def test_every_tierstream_command_line_names_real_commands_and_options() -> None:
    known = {" ".join(path): command for path, command in
             commands(typer.main.get_command(app), [])}
    checked, wrong = 0, []
    for page, code in blocks("bash"):
        for line in _command_lines(code):
            words = shlex.split(line.replace("$(", "").replace(")", ""))[1:]
            path = next((" ".join(words[:n]) for n in (2, 1) if " ".join(words[:n]) in known),
                        None)
            if path is None:
                if words and not words[0].startswith("-"):
                    wrong.append(f"{page.name}: no command in {line!r}")
                continue
            options = {o for p in known[path].params for o in (*p.opts, *p.secondary_opts)}
            options |= {"--help", "--debug"}
            for flag in (w.split("=", 1)[0] for w in words if w.startswith("--")):
                if flag not in options:
                    wrong.append(f"{page.name}: {path} has no option {flag} ({line!r})")
            checked += 1
    assert checked > 50, checked
    assert wrong == [], "\n".join(wrong)


def test_the_readmes_python_read_runs(broker: BrokerProcess) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic("acme/web/clicks", 4)
    with Producer("acme/web/clicks", broker=broker.url) as producer:
        producer.send_many({"key": f"user-{i % 5}", "value": b"click",
                            "publish_time": 1_793_491_200_000 + i} for i in range(100))
    code = re.search(r"```python\n(.*?)```", section("## Read a window from Python"), re.S)
    assert code
    _runs_ok(code.group(1) + "\nassert table.num_rows == 100 and splits\nprint('ok')\n",
             broker.url or "")


def test_the_readme_and_the_guide_say_what_is_not_when_or_how_it_was_built() -> None:
    """No test names or issue numbers (the history is CHANGELOG.md's and the commits'): the
    architecture page alone names the test files that hold the tree's rules."""
    wrong = []
    for page in pages():
        text = page.read_text()
        for pattern in (r"\bissue \d+", r"`tests/" if page.name != "architecture.md" else "$^",
                        r"\btest_[a-z_]{8,}"):
            wrong += [f"{page.name}: {m.group(0)!r}" for m in re.finditer(pattern, text)
                      if page.name != "architecture.md" or "test_" not in pattern]
    assert wrong == [], "\n".join(wrong)
