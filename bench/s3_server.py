"""A moto S3 server in a process of its own, behind a modelled network: each request waits
``latency`` and its body then arrives at ``bandwidth`` bytes/s (per request, as each S3
connection has its own), the model of ``bench remote-fs``. In its own process so that moto's
Python (signing checks, XML, copying bodies) does not share the reader's interpreter.

``python -m bench.s3_server PORT LATENCY_MS BANDWIDTH`` prints ``ready`` once serving.
``GET /__bench__/requests`` answers the GET requests counted so far (JSON) and resets them.

A ranged GET of a whole object is answered here, from moto's stored object, reading only the
range, as S3 does: moto itself reads the whole object for every ranged GET, under the
object's lock (a 4 MiB range of a 64 MB tier file cost a 64 MB read, one request at a time
per object), which capped every S3 read of ``bench remote`` (0.27 of local files) at moto's
speed rather than the modelled network's.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any


class _Network:
    """WSGI middleware: the modelled latency and bandwidth, and a count of GETs."""

    def __init__(self, app: Any, latency_s: float, bandwidth: float) -> None:
        self.app, self.latency_s, self.bandwidth = app, latency_s, bandwidth
        self.gets = 0
        self.lock = threading.Lock()

    def __call__(self, environ: Any, start_response: Any) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/__bench__/requests":
            with self.lock:
                gets, self.gets = self.gets, 0
            start_response("200 OK", [("Content-Type", "application/json")])
            return [json.dumps({"gets": gets}).encode()]
        t0 = time.monotonic()
        if environ.get("REQUEST_METHOD") == "GET":
            with self.lock:
                self.gets += 1
        ranged = _ranged_get(environ, start_response)
        body = b"".join(self.app(environ, start_response) if ranged is None else ranged)
        # the answer arrives one latency and its transfer after the request was sent
        wait = self.latency_s + len(body) / self.bandwidth - (time.monotonic() - t0)
        if wait > 0:
            time.sleep(wait)
        return [body]


def _ranged_get(environ: Any, start_response: Any) -> list[bytes] | None:
    """A ``GET /bucket/key`` with one ``bytes=a-b`` range, answered from the stored object
    (None: anything else, for moto to answer)."""
    import re
    from urllib.parse import unquote

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    match = re.fullmatch(r"bytes=(\d+)-(\d+)", environ.get("HTTP_RANGE", ""))
    bucket, _, name = unquote(environ.get("PATH_INFO", "")).lstrip("/").partition("/")
    if environ.get("REQUEST_METHOD") != "GET" or not match or not name or \
            environ.get("QUERY_STRING"):
        return None
    try:
        key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, name)
    except Exception:  # no such bucket: moto's own answer
        return None
    if key is None or int(match.group(1)) >= key.size:
        return None
    begin, end = int(match.group(1)), min(int(match.group(2)), key.size - 1)
    with key.lock:
        key._value_buffer.seek(begin)
        body = key._value_buffer.read(end - begin + 1)
    start_response("206 Partial Content", [
        ("Content-Type", "binary/octet-stream"), ("Content-Length", str(len(body))),
        ("Content-Range", f"bytes {begin}-{end}/{key.size}"), ("ETag", key.etag),
        ("Last-Modified", key.last_modified_RFC1123), ("Accept-Ranges", "bytes")])
    return [body]


def main() -> None:
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    port, latency_ms, bandwidth = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = _Network(DomainDispatcherApplication(create_backend_app), latency_ms / 1000,
                   bandwidth)
    server = make_server("127.0.0.1", port, app, threaded=True)
    print("ready", flush=True)
    server.serve_forever()


class S3Server:
    """The server as a child process (``with S3Server(...) as endpoint:``)."""

    def __init__(self, latency_ms: float = 10, bandwidth: float = 100e6) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.s3_server", str(self.port), str(latency_ms),
             str(bandwidth)], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError("the moto S3 server did not start")

    def gets(self) -> int:
        """GET requests since the last call."""
        import urllib.request

        with urllib.request.urlopen(f"{self.endpoint}/__bench__/requests") as answer:
            return int(json.loads(answer.read())["gets"])

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    main()
