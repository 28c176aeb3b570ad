"""``tierstream broker start``: the embedded broker in the foreground."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from tierstream.cli.common import (
    BrokerOpt,
    DataDirOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    TokenOpt,
    bookie_app,
    broker_app,
    say_moved,
)
from tierstream.options import (
    DEFAULT_ADMIN_PORT,
    DEFAULT_ADMIN_TLS_PORT,
    DEFAULT_BROKER_URL,
    DEFAULT_DATA_DIR,
    DEFAULT_PORT,
    DEFAULT_PULSAR_PORT,
    DEFAULT_PULSAR_TLS_PORT,
    OPTIONS,
)


def _help(key: str) -> str:
    return OPTIONS[key].help()  # one description and default: the option table's


@broker_app.command("start")
def broker_start(
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = DEFAULT_PORT,
    auth_token: TokenOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    bookie_endpoints: Annotated[bool, typer.Option(
        help="Serve each bookie's sealed ledgers on an endpoint of its own, so readers on "
             "other hosts read them directly.")] = True,
    advertised_address: Annotated[str | None, typer.Option(
        help="Host that readers on other machines reach the bookie endpoints at "
             "\\[default: --host].")] = None,
    bookie_port_base: Annotated[int, typer.Option(
        help="Bookie i's endpoint listens on this port + i (0: any free port, chosen at each "
             "start).")] = 0,
    pulsar_port: Annotated[int, typer.Option(
        help="Serve Pulsar's binary protocol here, for Pulsar clients (pulsar://HOST:PORT; "
             "0: off; closed with --tls-cert, see --pulsar-tls-port).")]
        = DEFAULT_PULSAR_PORT,
    pulsar_tls_port: Annotated[int | None, typer.Option(
        help="With --tls-cert: serve Pulsar clients here over TLS (pulsar+ssl://HOST:PORT; "
             f"0: off) \\[default: {DEFAULT_PULSAR_TLS_PORT}].", show_default=False)] = None,
    allow_auto_topic_creation: Annotated[bool, typer.Option(
        help="Create a topic (one partition) that a Pulsar client names and that does not "
             "exist, as Pulsar's broker does by default.")] = True,
    admin_port: Annotated[int | None, typer.Option(
        help="Serve the Pulsar admin REST subset (/admin/v2: create, grow and delete topics, "
             "stats, subscriptions) here, for curl and Pulsar tooling (0: off) \\[default: "
             f"{DEFAULT_ADMIN_PORT}; {DEFAULT_ADMIN_TLS_PORT}, as HTTPS, with --tls-cert].",
        show_default=False)] = None,
    metrics_port: Annotated[int | None, typer.Option(
        help="Serve Prometheus metrics on this port (0: any free port) \\[default: off].",
        show_default=False)] = None,
    metrics_host: Annotated[str, typer.Option(
        help="Address the metrics are served on (loopback by default; they are served "
             "without a token).")] = "127.0.0.1",
    bookies: Annotated[int, typer.Option(help=_help("bookies"), show_default=False)]
        = OPTIONS["bookies"].default,
    write_quorum: Annotated[int | None, typer.Option(help=_help("writeQuorum"))] = None,
    ack_quorum: Annotated[int | None, typer.Option(help=_help("ackQuorum"))] = None,
    max_entries_per_segment: Annotated[int | None, typer.Option(
        help=_help("maxEntriesPerSegment"))] = None,
    max_segment_bytes: Annotated[str | None, typer.Option(help=_help("maxSegmentBytes"))]
        = None,
    segment_rollover_time: Annotated[str | None, typer.Option(
        help=_help("segmentRolloverTime"))] = None,
    max_publish_time_ahead: Annotated[str | None, typer.Option(
        help=_help("maxPublishTimeAhead"))] = None,
    fsync: Annotated[bool, typer.Option(help=_help("fsync"), show_default=False)]
        = OPTIONS["fsync"].default,
    max_partitions_per_topic: Annotated[int | None, typer.Option(
        help=_help("maxPartitionsPerTopic"))] = None,
    max_open_ledgers: Annotated[int | None, typer.Option(help=_help("maxOpenLedgers"))]
        = None,
    tier_url: Annotated[str | None, typer.Option(
        envvar="TIERSTREAM_TIER_URL", help="Tier for offloaded segments: a path, file:// or "
        "s3://bucket/prefix (default: DATA_DIR/tier).")] = None,
    tier_shared: Annotated[bool, typer.Option(
        "--tier-shared", help="The --tier-url path is mounted on every broker host (needed "
        "for a path with --network-bookies or --standby).")] = False,
    s3_endpoint: Annotated[str | None, typer.Option(
        envvar="TIERSTREAM_S3_ENDPOINT", help="S3 endpoint (MinIO, moto); default AWS.")] = None,
    s3_region: Annotated[str | None, typer.Option(envvar="AWS_REGION", help="S3 region.")]
        = None,
    catalog_uri: Annotated[str | None, typer.Option(
        envvar="TIERSTREAM_CATALOG_URI", help="Iceberg SQL catalog URL, a SQLAlchemy URL "
        "(default: sqlite:///DATA_DIR/catalog.db; with --network-bookies or --standby, one "
        "every broker host reaches, e.g. postgresql+psycopg://user@host/db).")] = None,
    offload_after: Annotated[str | None, typer.Option(help=_help("offloadAfter"))] = None,
    offload_threshold: Annotated[str | None, typer.Option(help=_help("offloadThreshold"))]
        = None,
    deletion_lag: Annotated[str | None, typer.Option(help=_help("deletionLag"))] = None,
    tier_check_interval: Annotated[str | None, typer.Option(help=_help("tierCheckInterval"))]
        = None,
    transaction_timeout: Annotated[
        str | None, typer.Option(help=_help("transactionTimeout"))] = None,
    transaction_hold_limit: Annotated[
        str | None, typer.Option(help=_help("transactionHoldLimit"))] = None,
    auto_scale_rate: Annotated[int | None, typer.Option(help=_help("autoScaleRate"))] = None,
    auto_scale_window: Annotated[str | None, typer.Option(help=_help("autoScaleWindow"))]
        = None,
    client_refresh_wait: Annotated[
        str | None, typer.Option(help=_help("clientRefreshWait"))] = None,
    metadata: Annotated[str | None, typer.Option(
        envvar="TIERSTREAM_METADATA", show_envvar=False,
        help="Keep the metadata on PostgreSQL: postgresql://user@host:port/db (a password "
             "as user:password@, or in PGPASSWORD; env TIERSTREAM_METADATA) \\[default: "
             "SQLite in the data directory].",
        show_default=False)] = None,
    network_bookies: Annotated[bool, typer.Option(
        "--network-bookies", help="Write to the bookies registered in the metadata store "
        "(tierstream bookie serve --metadata ...) instead of directories in DATA_DIR; "
        "needs --metadata. Write quorum: as many as there are up to 3.")] = False,
    standby: Annotated[bool, typer.Option(
        "--standby", help="If another broker holds the metadata store, wait, and take the "
        "store over once it is silent for --takeover-after (needs --metadata). On a store "
        "served by --cluster brokers, start another --cluster broker instead: it owns "
        "nothing until partitions are created, orphaned or moved to it.")] = False,
    takeover_after: Annotated[str, typer.Option(
        help="With --standby: how long the serving broker must be silent before this one "
             "takes over.")] = "10s",
    cluster: Annotated[bool, typer.Option(
        "--cluster", help="Serve the store with other brokers started with --cluster: each "
        "partition is owned by one of them through a lease, and taken over when its owner's "
        "lease expires (needs --metadata and --network-bookies).")] = False,
    lease_timeout: Annotated[str, typer.Option(
        help="With --cluster: how long after its owner's last renewal a partition is taken "
             "over (and a broker that could not renew stops).")] = "10s",
    bookie_tls_ca: Annotated[str | None, typer.Option(
        help="PEM file of the CA that signed the network bookies' certificates (they serve "
             "grpc+tls://) \\[default: the system's].")] = None,
    bookie_timeout: Annotated[str, typer.Option(
        help="A network bookie that leaves an entry unanswered this long is taken for gone: "
             "the entry's ack quorum is decided by the others.")] = "10s",
    bookie_audit_interval: Annotated[str, typer.Option(
        help="How often every closed segment's copies are checked on the bookies (also "
             "whenever a bookie answers again); short ones are re-replicated.")] = "60s",
    log_level: Annotated[str, typer.Option(help="Log level.")] = "INFO",
    detach: Annotated[bool, typer.Option(
        "--detach", help="Run in the background: return once the broker serves (its address "
        "and pid printed), or with its error and a non-zero exit; its log goes to "
        "--log-file.")] = False,
    log_file: Annotated[Path | None, typer.Option(
        help="With --detach: the broker's log \\[default: DATA_DIR.log, beside the data "
             "directory].", show_default=False)] = None,
) -> None:
    """Start the broker in the foreground (or with --detach, in the background once it
    serves); SIGTERM or Ctrl-C stops it cleanly.

    Example: tierstream broker start --data-dir ./tierstream-data --port 6651
    """
    if detach:
        _detach(log_file or data_dir.with_name(data_dir.name + ".log"), data_dir)
    elif log_file is not None:
        raise typer.BadParameter("--log-file is for --detach (in the foreground the log is "
                                 "stderr)", param_hint="--log-file")
    from tierstream.broker.config import StoreConfig
    from tierstream.broker.run import run_broker

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tierstream.util.timeutil import parse_duration_ms
    from tierstream.wire.security import read_pem

    takeover_ms = parse_duration_ms(takeover_after, what="--takeover-after")
    lease_ms = parse_duration_ms(lease_timeout, what="--lease-timeout")
    timeout_ms = parse_duration_ms(bookie_timeout, what="--bookie-timeout")
    audit_ms = parse_duration_ms(bookie_audit_interval, what="--bookie-audit-interval")
    config = StoreConfig.from_options(
        metadata_url=metadata or None, network_bookies=network_bookies,
        takeover_after_s=takeover_ms / 1000 if standby else None,
        lease_timeout_s=lease_ms / 1000 if cluster else None,
        bookie_timeout_s=timeout_ms / 1000, bookie_audit_interval_s=audit_ms / 1000,
        tier_shared=tier_shared,
        bookie_token=auth_token,
        bookie_tls_ca=read_pem(bookie_tls_ca, "--bookie-tls-ca"), raw={
        "dataDir": str(data_dir), "bookies": bookies, "writeQuorum": write_quorum,
        "ackQuorum": ack_quorum, "maxEntriesPerSegment": max_entries_per_segment,
        "maxSegmentBytes": max_segment_bytes, "segmentRolloverTime": segment_rollover_time,
        "maxPublishTimeAhead": max_publish_time_ahead,
        "fsync": fsync, "maxPartitionsPerTopic": max_partitions_per_topic,
        "maxOpenLedgers": max_open_ledgers,
        "tierUrl": tier_url, "s3Endpoint": s3_endpoint, "s3Region": s3_region,
        "catalogUri": catalog_uri, "offloadAfter": offload_after,
        "offloadThreshold": offload_threshold, "deletionLag": deletion_lag,
        "tierCheckInterval": tier_check_interval, "transactionTimeout": transaction_timeout,
        "transactionHoldLimit": transaction_hold_limit,
        "autoScaleRate": auto_scale_rate, "autoScaleWindow": auto_scale_window,
        "clientRefreshWait": client_refresh_wait,
    })

    def ready(url: str, served: dict[str, str]) -> None:
        policy = _offload_policy(config)
        if policy:  # before the line that says it is ready: all of the banner is out then
            print(policy, flush=True)
        for what, where in served.items():  # metrics, pulsar clients, pulsar admin
            print(f"{what}: {where}", flush=True)
        print(f"tierstream broker listening on {url} (data dir {config.data_dir})", flush=True)

    run_broker(config, host=host, port=port, auth_token=auth_token, ready=ready,
               tls_cert=tls_cert, tls_key=tls_key, bookie_endpoints=bookie_endpoints,
               advertised_address=advertised_address, bookie_port_base=bookie_port_base,
               metrics_port=metrics_port, metrics_host=metrics_host, pulsar_port=pulsar_port,
               pulsar_tls_port=pulsar_tls_port, pulsar_auto_create=allow_auto_topic_creation,
               admin_port=admin_port)


@broker_app.command("stop")
def broker_stop(
    data_dir: DataDirOpt = Path(DEFAULT_DATA_DIR),
    timeout: Annotated[str, typer.Option(help="How long to wait for a clean stop.")] = "60s",
) -> None:
    """Stop the broker of DATA_DIR on this host, serving or standing by (SIGTERM: it seals
    its open segments and exits cleanly), and wait until it did.

    Example: tierstream broker stop --data-dir ./tierstream-data
    """
    import os
    import signal
    import time

    from tierstream.broker.data_dir import holder_pid
    from tierstream.errors import ConfigError, NotFoundError, UnavailableError
    from tierstream.model.layout import DataDir
    from tierstream.util.timeutil import parse_duration_ms

    wait_s = parse_duration_ms(timeout, what="--timeout") / 1000
    if data_dir.exists() and not data_dir.is_dir():
        raise ConfigError(f"--data-dir {str(data_dir)!r} is a file, not a data directory")
    lock = DataDir(data_dir).lock
    pid = holder_pid(lock)
    if pid is None:
        raise NotFoundError(f"no broker serves {str(data_dir)!r} on this host")
    if pid < 0:
        raise UnavailableError(f"a broker holds {str(data_dir)!r} but did not say its pid (an "
                               "older tierstream): stop it with SIGTERM")
    if not _holds(pid, lock):  # a stale pid in the lock file, reused by another process
        raise ConfigError(f"{str(lock)!r} is locked, but the pid it records ({pid}) does not "
                          "hold it: nothing was stopped; find the process that does (fuser "
                          f"{lock})")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while holder_pid(lock) is not None:
        if time.monotonic() > deadline:
            raise UnavailableError(f"the broker (pid {pid}) did not stop within {timeout}")
        time.sleep(0.1)  # polling the lock the broker lets go of as it exits
    print(f"stopped the broker of {data_dir} (pid {pid})")


def _holds(pid: int, lock: Path) -> bool:
    """Whether process ``pid`` has ``lock`` open (not when /proc does not let us see: a
    process of another user, which this one could not stop either)."""
    import os

    try:
        links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        return False
    return str(lock.resolve()) in links


@broker_app.command("drain")
def broker_drain(
    broker: BrokerOpt = DEFAULT_BROKER_URL,
    tls_ca: TlsCaOpt = None,
    auth_token: TokenOpt = None,
) -> None:
    """Move every partition the broker named serves to the other brokers of its cluster
    (brokers started with --cluster): each is sealed and handed over, and its clients follow
    it. The broker keeps running, owning nothing, until it is stopped.

    Example: tierstream broker drain --broker grpc://broker2:6651
    """
    from tierstream.client import Admin

    with Admin(broker, auth_token=auth_token) as admin:
        moved = admin.drain()
    say_moved(moved)


@bookie_app.command("serve")
def bookie_serve(
    dir_: Annotated[Path, typer.Option("--data-dir", "--dir", help="The bookie's directory, "
                                       "e.g. DATA_DIR/bookies/bookie-0 (created for a "
                                       "network bookie).")],
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 0,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")]
        = "127.0.0.1",
    bookie_id: Annotated[str | None, typer.Option(
        help="The bookie's id \\[default: the directory's name].")] = None,
    advertised_address: Annotated[str | None, typer.Option(
        help="Address readers and brokers reach this endpoint at: host, host:port or URL "
             "\\[default: the bound one].")] = None,
    metadata: Annotated[str | None, typer.Option(
        envvar="TIERSTREAM_METADATA", show_envvar=False,
        help="Take writes, as a network bookie registered in this metadata store "
             "(postgresql://...), where brokers started with --network-bookies find it "
             "(env TIERSTREAM_METADATA).", show_default=False)] = None,
    host_label: Annotated[str | None, typer.Option(
        help="The machine (or rack) this bookie runs on: a segment's copies go to distinct "
             "ones \\[default: the advertised address's host].")] = None,
    fsync: Annotated[bool, typer.Option(help="fsync every group of writes before "
                                        "acknowledging it.")] = True,
    replace: Annotated[bool, typer.Option(
        "--replace", help="With --metadata: this empty directory takes the place of the "
                          "bookie's lost disk; the copies it held are re-replicated onto "
                          "it and others. Without it, a bookie whose disk lost its copies "
                          "refuses to start.")] = False,
    broker: Annotated[str | None, typer.Option(
        "--broker", help="Register the address with this broker as the read endpoint of one "
                         "of its own bookies (else readers are not told of it).")] = None,
    auth_token: TokenOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
) -> None:
    """Serve one bookie directory in the foreground: its sealed ledgers to readers, and with
    --metadata, writes from brokers (a network bookie). A network bookie's directory carries
    a cookie that must match its registration: an empty or foreign disk is never taken for
    the bookie's own (see --replace).

    Example: tierstream bookie serve --data-dir /srv/bookie-1 --port 3181 --host 0.0.0.0
    --advertised-address bookie1.example:3181 --metadata postgresql://tierstream@db/tierstream
    --auth-token ...
    """
    from tierstream.bookie.server import serve_bookie
    from tierstream.wire.security import read_pem

    def ready(server: object, address: str) -> None:
        role = "network bookie" if metadata else "bookie endpoint"
        print(f"tierstream {role} listening on {address} (dir {dir_})", flush=True)

    serve_bookie(dir_, host=host, port=port, bookie_id=bookie_id, auth_token=auth_token,
                 tls_cert=tls_cert, tls_key=tls_key, broker=broker,
                 advertised_address=advertised_address, tls_ca=read_pem(tls_ca, "--tls-ca"),
                 metadata=metadata, host_label=host_label, fsync=fsync, ready=ready,
                 replace=replace)


def _detach(log_file: Path, data_dir: Path) -> None:
    """Start this same command without --detach in a session of its own, its output to
    ``log_file``; return (exit 0) once it serves (a standby: once it stands by for the
    serving broker), printing what it printed, or exit with its error and status (Pulsar's
    ``pulsar-daemon start``)."""
    import os
    import subprocess
    import time

    from tierstream.metadata.leader_lease import STANDING_BY

    args, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--detach":
            continue
        if a == "--log-file":
            skip = True
            continue
        if not a.startswith("--log-file="):
            args.append(a)
    try:
        log = open(log_file, "a")  # noqa: SIM115 - handed to the child
    except OSError as exc:
        raise typer.BadParameter(f"cannot write {str(log_file)!r}: {exc.strerror}",
                                 param_hint="--log-file") from None
    start = log.tell()
    child = subprocess.Popen([sys.executable, "-m", "tierstream", *args], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    while True:
        with open(log_file) as f:
            f.seek(start)
            said = f.read()
        if "tierstream broker listening on" in said:
            for line in said.splitlines():
                if not line[:4].isdigit():  # the banner, not the log's timestamped lines
                    print(line)
            print(f"broker running in the background: pid {child.pid}, log {log_file} "
                  f"(stop it with: tierstream broker stop --data-dir {data_dir})", flush=True)
            raise typer.Exit(0)
        if STANDING_BY in said:  # a standby is ready once it waits for the serving broker
            print(f"standby running in the background: pid {child.pid}; it takes over once "
                  f"the serving broker is silent (log {log_file}; stop it with: tierstream "
                  f"broker stop --data-dir {data_dir})", flush=True)
            raise typer.Exit(0)
        code = child.poll()
        if code is not None:
            errors = [line for line in said.splitlines() if line.startswith("error:")]
            for line in errors or said.splitlines()[-5:]:
                print(line, file=sys.stderr)
            raise typer.Exit(code or 1)
        time.sleep(0.1)  # polling the child's log for its first line


def _offload_policy(config: Any) -> str | None:
    """The automatic offload settings in words (None when there are none), so that a unit
    typed wrong shows at start, not when data has moved."""
    from tierstream.util.timeutil import describe_duration
    from tierstream.util.units import human_bytes

    rules = []
    if config.offload_after_ms is not None:
        rules.append("closed segments whose newest message is older than "
                     f"{describe_duration(config.offload_after_ms)}")
    if config.offload_threshold_bytes is not None:
        rules.append("the oldest closed segments while a topic has more than "
                     f"{human_bytes(config.offload_threshold_bytes)} not yet offloaded")
    if not rules:
        return None
    return (f"offload to the tier: {' and '.join(rules)}; bookie copies deleted "
            f"{describe_duration(config.deletion_lag_ms)} after; checked every "
            f"{describe_duration(config.tier_check_interval_ms)}")
