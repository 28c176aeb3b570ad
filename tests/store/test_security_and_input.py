"""Tokens, and every kind of bad input getting a clear error that names the value."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer, read
from tierstream.errors import AuthError, ConfigError, NotFoundError, UnavailableError
from tierstream.model.positions import KeyRange, Offset

from ..timing import scaled

TOKEN = "s3cret-token-value"


def test_wrong_or_missing_token_is_denied_and_never_echoed(start_broker) -> None:
    broker = start_broker("--auth-token", TOKEN)
    with Admin(broker.url, auth_token=TOKEN) as admin:
        admin.create_topic("a/b/c", 1)
    for token in (None, "wrong"):
        with pytest.raises(AuthError) as info, Admin(broker.url, auth_token=token) as admin:
            admin.list_topics()
        assert TOKEN not in str(info.value)
        with pytest.raises(AuthError):
            list(read("a/b/c", broker=broker.url, auth_token=token, end=Offset.latest()))
    broker.stop()
    assert TOKEN not in "".join(broker.stderr_tail)


def test_token_from_environment(start_broker, monkeypatch) -> None:
    broker = start_broker(env={"TIERSTREAM_AUTH_TOKEN": TOKEN})
    monkeypatch.setenv("TIERSTREAM_AUTH_TOKEN", TOKEN)
    with Admin(broker.url) as admin:
        assert admin.ping()
    monkeypatch.delenv("TIERSTREAM_AUTH_TOKEN")
    with pytest.raises(AuthError), Admin(broker.url) as admin:
        admin.ping()


def test_non_loopback_bind_without_token_is_refused(data_dir) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tierstream", "broker", "start", "--host", "0.0.0.0",
         "--port", "0", "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=scaled(60),
        env={k: v for k, v in __import__("os").environ.items()
             if k != "TIERSTREAM_AUTH_TOKEN"},
    )
    assert proc.returncode == 1
    assert "non-loopback" in proc.stderr and "--auth-token" in proc.stderr
    assert not (data_dir / "metadata.db").exists(), "refused broker must not create a store"


def test_bad_requests_name_the_bad_value(broker: BrokerProcess) -> None:
    url = broker.url
    assert url is not None
    with Admin(url) as admin:
        admin.create_topic("acme/web/clicks", 2)
        with pytest.raises(NotFoundError, match="'acme/web/nope'"):
            admin.get_topic("acme/web/nope")
        with pytest.raises(ConfigError, match="invalid partition count -3"):
            admin.create_topic("acme/web/x", -3)
        with pytest.raises(ConfigError, match="invalid topic name"):
            admin.create_topic("acme/../etc", 1)
    with pytest.raises(ConfigError, match="invalid partition 7"):
        read("acme/web/clicks", partition=7, broker=url, end=Offset.latest())
    with pytest.raises(NotFoundError, match="nope"):
        Producer("acme/web/nope", broker=url)
    with pytest.raises(ConfigError, match="invalid key range"):
        read("acme/web/clicks", broker=url, key_ranges=[KeyRange(10, 5)])


def test_unreachable_broker_is_a_clear_error() -> None:
    unreachable = r"cannot reach the broker at grpc://127\.0\.0\.1:1"
    with pytest.raises(UnavailableError, match=unreachable), \
            Admin("grpc://127.0.0.1:1", timeout=scaled(5)) as admin:
        admin.ping()
    with pytest.raises(ConfigError, match="invalid broker URL"):
        Admin("http://localhost:80")


def test_a_data_directory_serves_one_broker_at_a_time(start_broker, data_dir) -> None:
    start_broker()
    with pytest.raises(UnavailableError, match="already in use"):
        BrokerProcess(data_dir).start(timeout=scaled(30))


def test_every_port_taken_is_named_in_one_line_with_its_option(tmp_path) -> None:
    """Regression: a taken Flight port said only "cannot listen on ...", and several taken
    ports were reported one per try."""
    import socket

    held = []
    try:
        for _ in range(3):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            held.append(s)
        flight, pulsar, admin = (str(s.getsockname()[1]) for s in held)
        done = subprocess.run(
            [sys.executable, "-m", "tierstream", "broker", "start", "--data-dir",
             str(tmp_path / "d"), "--port", flight, "--pulsar-port", pulsar, "--admin-port",
             admin], capture_output=True, text=True, timeout=scaled(60))
    finally:
        for s in held:
            s.close()
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    for port, option in ((flight, "--port"), (pulsar, "--pulsar-port"),
                         (admin, "--admin-port")):
        assert f"{port} ({option}" in done.stderr, done.stderr
    assert not (tmp_path / "d").exists()
