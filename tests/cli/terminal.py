"""Running a command in a real terminal of a given size (a pseudo-terminal), as a user sees
it: rich sizes its output from the terminal, not from COLUMNS."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios

from ..timing import scaled


def in_terminal(argv: list[str], env: dict[str, str], columns: int = 80) -> tuple[int, str]:
    """Run ``argv`` with its stdout on a terminal ``columns`` wide; its exit status and what
    it showed, colours taken out."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    clean = {k: v for k, v in {**os.environ, **env}.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(argv, stdout=slave, stderr=subprocess.PIPE,
                            env={**clean, "TERM": "xterm"})
    os.close(slave)
    shown = b""
    while True:
        try:
            ready = select.select([master], [], [], scaled(60))[0]
            chunk = os.read(master, 65536) if ready else b""
        except OSError:  # the command exited and closed the terminal
            chunk = b""
        if not chunk:
            break
        shown += chunk
    os.close(master)
    code = proc.wait(timeout=scaled(60))
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode()).replace("\r\n", "\n")
