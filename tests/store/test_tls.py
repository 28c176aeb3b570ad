"""TLS on the broker and the bookie endpoints, with a throwaway certificate made per test."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from tierstream.bookie.server import BookieServer
from tierstream.broker.flight.server import Broker
from tierstream.client import Admin
from tierstream.enumerator import Enumerator, Query
from tierstream.errors import AuthError, ConfigError, UnavailableError
from tierstream.metadata.bookie_registry import set_bookie_endpoint
from tierstream.readers import ReadStats, open_reader
from tierstream.readers.stats import ENDPOINT
from tierstream.splits.split import ReaderKind
from tierstream.wire.security import check_bind

from ..logs import TOPIC, fill, running_log
from ..timing import scaled


def make_cert(directory: Path, name: str = "tierstream-test") -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) for localhost and 127.0.0.1: (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_the_broker_serves_tls_and_clients_check_it_against_the_ca(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    other, _ = make_cert(tmp_path, "someone-else")
    with running_log(tmp_path / "data") as log:
        broker = Broker(log.store, port=0, tls_cert=str(cert), tls_key=str(key))
        threading.Thread(target=broker.serve, daemon=True).start()
        try:
            assert broker.url.startswith("grpc+tls://127.0.0.1:")
            with Admin(broker.url, tls_ca=cert.read_bytes()) as admin:
                assert admin.ping()
            with Admin(broker.url, tls_ca=str(cert)) as admin:  # a path works as well
                assert admin.ping()
            for wrong in (other.read_bytes(), None):  # another CA, the system's CAs
                with Admin(broker.url, tls_ca=wrong, timeout=scaled(5)) as admin, \
                        pytest.raises(UnavailableError, match="cannot reach the broker"):
                    admin.ping()
            plain = broker.url.replace("grpc+tls://", "grpc://")
            with Admin(plain, timeout=scaled(5)) as admin, pytest.raises(UnavailableError):
                admin.ping()
        finally:
            broker.shutdown()


def test_bookie_endpoints_serve_tls_to_readers_given_the_ca(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    with running_log(tmp_path / "data", maxEntriesPerSegment=5) as log:
        fill(log, partitions=1, batches=4)
        log.store.partitions(TOPIC)[0].seal()
        server = BookieServer(log.store.bookies["bookie-0"].root, bookie_id="bookie-0",
                              tls_cert=str(cert), tls_key=str(key))
        threading.Thread(target=server.serve, daemon=True).start()
        try:
            set_bookie_endpoint(log.store.metadata, "bookie-0", server.url)
            with Enumerator(data_dir=log.data_dir, broker=log.url) as enum:
                splits = [replace(s, replicas=tuple(replace(r, local_dir=None)
                                                    for r in s.replicas))
                          for s in enum.plan(Query(topics=(TOPIC,)))
                          if s.reader is ReaderKind.BOOKIE]
            assert splits and splits[0].replicas[0].endpoint == server.url
            stats = ReadStats()
            rows = sum(b.num_rows for s in splits
                       for b in open_reader(s, tls_ca=cert.read_bytes(), stats=stats))
            assert rows == stats.rows(path=ENDPOINT) == 200  # 4 batches of 50
            with pytest.raises(UnavailableError, match="no bookie endpoint could serve"):
                list(open_reader(splits[0]))  # not trusted without the CA
        finally:
            server.shutdown()


def test_tls_needs_both_halves_and_readable_pem_files(tmp_path: Path) -> None:
    cert, _ = make_cert(tmp_path)
    with running_log(tmp_path / "data") as log:
        with pytest.raises(ConfigError, match="both --tls-cert and --tls-key"):
            Broker(log.store, port=0, tls_cert=str(cert))
        with pytest.raises(ConfigError, match=r"cannot read --tls-key '/nonexistent\.key'"):
            Broker(log.store, port=0, tls_cert=str(cert), tls_key="/nonexistent.key")
        with pytest.raises(ConfigError, match="not a PEM file"):
            BookieServer(tmp_path, tls_cert=str(cert), tls_key=str(tmp_path / "data" /
                                                                    "metadata.db"))


def test_a_non_loopback_bind_needs_a_token_and_warns_without_tls(
        caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(AuthError, match="refusing to bind the bookie endpoint"):
        check_bind("10.1.2.3", auth_token=None, tls=False, what="bookie endpoint")
    with caplog.at_level(logging.WARNING):
        check_bind("10.1.2.3", auth_token="t", tls=False, what="broker")
    assert "without TLS" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_bind("10.1.2.3", auth_token="t", tls=True, what="broker")
        check_bind("127.0.0.1", auth_token=None, tls=False, what="broker")
    assert not caplog.text


def test_producer_consumer_and_read_take_the_ca(tmp_path: Path) -> None:
    from tierstream.client import Consumer, Producer, read
    from tierstream.model.positions import Offset

    cert, key = make_cert(tmp_path)
    with running_log(tmp_path / "data") as log:
        log.store.create_topic(TOPIC, 2)
        broker = Broker(log.store, port=0, tls_cert=str(cert), tls_key=str(key))
        threading.Thread(target=broker.serve, daemon=True).start()
        try:
            with Producer(TOPIC, broker=broker.url, tls_ca=str(cert)) as producer:
                producer.send_many({"key": f"k{i}", "value": f"v{i}"} for i in range(50))
            got = sum(b.num_rows for b in read(TOPIC, broker=broker.url, tls_ca=str(cert),
                                               end=Offset.latest()))
            assert got == 50
            with Consumer(TOPIC, "s", broker=broker.url, tls_ca=cert.read_bytes(),
                          initial=Offset.earliest()) as consumer:
                seen = 0
                while seen < 50:
                    batch = consumer.receive(timeout=scaled(10))
                    assert batch is not None
                    seen += batch.num_rows
        finally:
            broker.shutdown()


def test_metrics_are_served_over_https_with_the_broker_s_certificate(tmp_path: Path) -> None:
    import ssl
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tierstream.broker.stats.metrics import MetricsServer

    cert, key = make_cert(tmp_path)
    with running_log(tmp_path / "data") as log:
        fill(log, partitions=1, batches=2)
        broker = log.broker
        metrics = MetricsServer(log.store, broker.subscriptions, broker.streams, broker.lags,
                                host="127.0.0.1", port=0, tls_cert=str(cert),
                                tls_key=str(key))
        try:
            assert metrics.url.startswith("https://127.0.0.1:")
            trusted = ssl.create_default_context(cafile=str(cert))
            with urllib.request.urlopen(metrics.url, timeout=scaled(10),
                                        context=trusted) as response:
                names = {f.name for f in text_string_to_metric_families(
                    response.read().decode())}
            assert {"tierstream_rate_in", "tierstream_storage_size"} <= names
            with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
                urllib.request.urlopen(metrics.url, timeout=scaled(10),
                                       context=ssl.create_default_context())
            plain = metrics.url.replace("https://", "http://")
            with pytest.raises((urllib.error.URLError, ConnectionError)):
                urllib.request.urlopen(plain, timeout=scaled(10))
        finally:
            metrics.shutdown()
