"""The Spark driver JVM's stderr, passed on by tierstream so that it can be silenced.

Everything the driver JVM writes to stderr reaches the terminal: its log4j console, and the
stderr of the Python workers it starts (Spark copies theirs into its own). A session that
:func:`tierstream.spark_adapter.jobs.local_spark` starts hands the JVM a pipe instead of this
process's stderr, and a :class:`DriverOutput` copies the pipe to stderr line by line until
it is muted.

Why: a command that stops Spark on purpose (Ctrl-C on ``tierstream tail``, the end of a
backfill) reports the stop itself, in one line. While Spark shuts down, PySpark's streaming
source worker can find its socket closed (EOF), then fail to report that on the closed socket
(broken pipe), and print both tracebacks: noise about a stop the user asked for. Once muted,
the pipe is still drained (a full pipe would block the JVM) and the lines are dropped.
``--debug`` (``TIERSTREAM_DEBUG``) never mutes.

Nor, from the start, the lines every driver JVM prints as it starts whatever it runs (the
JDK's incubator-module notice, log4j's default-profile banner, Hadoop's native-library
warning): five lines of Spark in the middle of a command's output, nothing a user acts on.
They are dropped unless ``--debug`` was given.
"""

from __future__ import annotations

import os

from tierstream.util.threads import Worker

__all__ = ["DriverOutput", "launch_driver", "mute_driver_output"]

_current: DriverOutput | None = None  # the relay of this process's driver JVM, if it has one

#: how the start-up lines of every driver JVM begin (log4j's after its time stamp)
_STARTUP = (b"WARNING: Using incubator modules: ", b"Using Spark's default log4j profile: ",
            b'Setting default log level to "', b"To adjust logging level use sc.setLogLevel(")
_STARTUP_LOGGED = (b" WARN NativeCodeLoader: Unable to load native-hadoop library",)


def _startup_line(line: bytes) -> bool:
    return line.startswith(_STARTUP) or any(part in line for part in _STARTUP_LOGGED)


class DriverOutput:
    """Copies what is written to the pipe ``read_fd`` to ``out_fd``, line by line (but the
    JVM's start-up lines, unless ``TIERSTREAM_DEBUG``), until muted; drains it, dropping
    lines, after that. Ends when every writer has closed the pipe (the JVM has exited)."""

    def __init__(self, read_fd: int, out_fd: int = 2) -> None:
        self._in = os.fdopen(read_fd, "rb", buffering=0)
        self._out = out_fd
        self.muted = False
        self._quiet_start = not os.environ.get("TIERSTREAM_DEBUG")  # drop start-up lines
        self._worker = Worker("spark-driver-stderr", self._relay).start()

    def _relay(self) -> None:
        with self._in:
            pending = b""
            while chunk := self._in.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if self._quiet_start:
                    lines = [line for line in lines if not _startup_line(line)]
                if not self.muted and lines:
                    os.write(self._out, b"".join(line + b"\n" for line in lines))
            if pending and not self.muted:
                os.write(self._out, pending)

    def mute(self) -> None:
        self.muted = True

    def join(self, timeout: float | None = None) -> None:
        """Wait until the pipe's writers have all closed it and the rest is passed on."""
        self._worker.join(timeout)


def launch_driver(conf: dict[str, str]) -> None:
    """Start this process's Spark driver JVM (PySpark's gateway) with its stderr piped
    through a :class:`DriverOutput`, with ``conf`` on its command line as a session builder
    passes it. Does nothing if a driver is running already or PySpark was given one
    (``PYSPARK_GATEWAY_PORT``)."""
    global _current
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ:
        return
    spark_conf = SparkConf()
    for key, value in conf.items():
        spark_conf.set(key, value)
    read_fd, write_fd = os.pipe()  # relayed from the start: a JVM that fails to start says why
    relay = DriverOutput(read_fd)
    try:
        gateway = launch_gateway(spark_conf, popen_kwargs={"stderr": write_fd})
    finally:
        os.close(write_fd)  # the JVM (and what it starts) holds the only writers now
    SparkContext._ensure_initialized(gateway=gateway)
    _current = relay


def mute_driver_output() -> None:
    """From now on, drop what the driver JVM of this process writes to stderr (unless
    ``TIERSTREAM_DEBUG`` is set, or the session was not started by tierstream)."""
    if _current is not None and not os.environ.get("TIERSTREAM_DEBUG"):
        _current.mute()
