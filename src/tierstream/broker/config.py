"""Configuration of the embedded store, built from the option table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tierstream.errors import ConfigError
from tierstream.managed_ledger.bookies.placement import check_quorums
from tierstream.model.layout import DataDir
from tierstream.options import parse_options
from tierstream.tier.storage import TierStorage

__all__ = ["StoreConfig"]


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Everything the embedded store needs to open. Keyword-only; see ``options.py``."""

    data_dir: Path
    bookies: int = 1
    write_quorum: int = 1
    ack_quorum: int = 1
    max_entries_per_segment: int = 50_000
    max_segment_bytes: int = 256 * 1024**2
    segment_rollover_ms: int = 4 * 3_600_000
    max_publish_ahead_ms: int = 3_600_000
    fsync: bool = True
    max_partitions_per_topic: int = 1024
    max_open_ledgers: int = 512
    tier_url: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    catalog_uri: str | None = None
    tier_layout: str = "key-buckets"
    offload_after_ms: int | None = None
    offload_threshold_bytes: int | None = None
    deletion_lag_ms: int = 10 * 60_000
    tier_check_interval_ms: int = 30_000
    transaction_timeout_ms: int = 15 * 60_000
    transaction_hold_limit_ms: int = 30_000
    auto_scale_rate: int | None = None
    auto_scale_window_ms: int = 60_000
    #: how long a client-routed topic's growth is announced before it is read (growth.py)
    client_refresh_wait_ms: int = 90_000
    #: ``postgresql://user@host/db``: the metadata on PostgreSQL (``metadata/postgres.py``);
    #: None: the SQLite file in the data directory
    metadata_url: str | None = None
    #: write to the bookies registered in the metadata as network services (``tierstream
    #: bookie serve``) instead of directories here; a write/ack quorum of 0 is resolved from
    #: how many there are (3 of them, 2; at most 3 copies)
    network_bookies: bool = False
    #: the token and CA the broker presents to / trusts of network bookies
    bookie_token: str | None = None
    bookie_tls_ca: bytes | None = None
    #: a network bookie that leaves an entry unanswered this long is taken for gone
    bookie_timeout_s: float = 10.0
    #: how often every closed segment's copies on the bookies are checked
    #: (managed_ledger/bookies/repair.py)
    bookie_audit_interval_s: float = 60.0
    #: the tier URL is a path that every broker host mounts (with --network-bookies or
    #: --standby a host-local tier is refused: a broker on another host could not read it)
    tier_shared: bool = False
    #: a standby: wait for the metadata database held by another broker, and take it over
    #: once that broker was silent this long (PostgreSQL metadata only)
    takeover_after_s: float | None = None
    #: one of several brokers serving the store (``--cluster``, broker/cluster/membership.py): each
    #: partition owned through a lease that expires this long after its last renewal
    lease_timeout_s: float | None = None

    def __post_init__(self) -> None:
        from tierstream.metadata.backend import POSTGRES_SCHEMES

        if self.metadata_url is not None and not self.metadata_url.startswith(
                POSTGRES_SCHEMES):
            raise ConfigError(f"invalid --metadata {self.metadata_url!r}: expected "
                              "postgresql://user@host[:port]/database (or nothing: SQLite in "
                              "the data directory)")
        if self.takeover_after_s is not None and self.metadata_url is None:
            raise ConfigError("--standby needs --metadata postgresql://...: a broker on "
                              "another host takes over a store whose metadata it can reach")
        _check_places(self)
        if self.lease_timeout_s is not None:
            _check_cluster(self)
        if (self.network_bookies or self.takeover_after_s is not None) and \
                self.metadata_url is not None and not self.tier_shared and \
                _host_local(self.tier_url):
            flag = "--network-bookies" if self.network_bookies else "--standby"
            where = self.tier_url or "the default, DATA_DIR/tier"
            raise ConfigError(
                f"{flag}: the tier ({where}) is on this host only, and a broker that takes "
                "the store over on another host could not read what this one offloads: give "
                "--tier-url s3://bucket/prefix (with --catalog-uri on a shared database), or a "
                "path every broker host mounts with --tier-shared")
        if (self.network_bookies or self.takeover_after_s is not None) and \
                self.metadata_url is not None and self.catalog_uri is None:
            flag = "--network-bookies" if self.network_bookies else "--standby"
            raise ConfigError(
                f"{flag}: the Iceberg catalog (the default, DATA_DIR/catalog.db) is on this "
                "host only, and a broker that takes the store over on another host would "
                "register its offloads in a catalog of its own: give --catalog-uri on a "
                "database every broker host reaches (e.g. the metadata database: "
                "postgresql+psycopg://user@host/database)")
        if self.network_bookies:
            if self.metadata_url is None:
                raise ConfigError("--network-bookies needs --metadata postgresql://...: "
                                  "the bookies register there, where every broker finds them")
            if self.write_quorum and self.ack_quorum:  # else resolved from the bookies found
                check_quorums(self.write_quorum, self.ack_quorum, self.write_quorum)
            return
        check_quorums(self.write_quorum, self.ack_quorum, self.bookies)

    @classmethod
    def from_options(cls, raw: Mapping[str, Any] | None = None, **overrides: Any) -> StoreConfig:
        """Parse ``raw`` (option keys such as ``maxEntriesPerSegment``) through ``options.py``."""
        opts = parse_options({k: v for k, v in (raw or {}).items() if v is not None},
                             scope="store")
        bookies = opts["bookies"]
        if overrides.get("network_bookies"):  # resolved by the store from those registered
            write_quorum = opts["writeQuorum"] or 0
            ack_quorum = opts["ackQuorum"] or (write_quorum // 2 + 1 if write_quorum else 0)
        else:
            write_quorum = opts["writeQuorum"] or bookies
            ack_quorum = opts["ackQuorum"] or (write_quorum // 2 + 1)
        values: dict[str, Any] = dict(
            data_dir=Path(opts["dataDir"]),
            bookies=bookies,
            write_quorum=write_quorum,
            ack_quorum=ack_quorum,
            max_entries_per_segment=opts["maxEntriesPerSegment"],
            max_segment_bytes=opts["maxSegmentBytes"],
            segment_rollover_ms=opts["segmentRolloverTime"],
            max_publish_ahead_ms=opts["maxPublishTimeAhead"],
            fsync=opts["fsync"],
            max_partitions_per_topic=opts["maxPartitionsPerTopic"],
            max_open_ledgers=opts["maxOpenLedgers"],
            tier_url=opts["tierUrl"],
            s3_endpoint=opts["s3Endpoint"],
            s3_region=opts["s3Region"],
            catalog_uri=opts["catalogUri"],
            tier_layout=opts["tierLayout"],
            offload_after_ms=opts["offloadAfter"],
            offload_threshold_bytes=opts["offloadThreshold"],
            deletion_lag_ms=opts["deletionLag"],
            tier_check_interval_ms=opts["tierCheckInterval"],
            transaction_timeout_ms=opts["transactionTimeout"],
            transaction_hold_limit_ms=opts["transactionHoldLimit"],
            auto_scale_rate=opts["autoScaleRate"],
            auto_scale_window_ms=opts["autoScaleWindow"],
            client_refresh_wait_ms=opts["clientRefreshWait"],
        )
        values.update(overrides)
        return cls(**values)

    @property
    def layout(self) -> DataDir:
        return DataDir.at(self.data_dir)

    @property
    def metadata_path(self) -> Path:
        return self.layout.metadata

    @property
    def metadata_where(self) -> str | Path:
        """Where the metadata is: the PostgreSQL URL, or the SQLite file."""
        return self.metadata_url or self.metadata_path

    def bookie_dir(self, bookie_id: str) -> Path:
        return self.layout.bookie(bookie_id)

    def tier(self) -> TierStorage:
        location = self.tier_url or str(self.layout.tier)
        return TierStorage.from_location(location, s3_endpoint=self.s3_endpoint,
                                         s3_region=self.s3_region, layout=self.tier_layout)

    @property
    def catalog(self) -> str:
        return self.catalog_uri or self.layout.catalog_uri


def _host_local(tier_url: str | None) -> bool:
    """Whether the tier lives on this host's file system (no URL: the data directory's)."""
    if tier_url is None:
        return True
    scheme = tier_url.split("://", 1)[0] if "://" in tier_url else ""
    return scheme in ("", "file", "local")


def _check_places(config: StoreConfig) -> None:
    """The tier and the catalog, checked before the broker creates anything: a tier URL it
    can write to, a catalog URI SQLAlchemy can parse (a SQLite one in a directory that
    exists). Before, these failed at the first offload, or after the data directory was
    made."""
    if config.tier_url is not None:
        tier = TierStorage.from_location(config.tier_url)  # ConfigError for a bad scheme
        if tier.scheme == "file":
            path = Path(urlparse(tier.url).path)
            if path.exists() and not path.is_dir():
                raise ConfigError(f"invalid --tier-url {config.tier_url!r}: {str(path)!r} is "
                                  "a file, not a directory")
    if config.catalog_uri is not None:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(config.catalog_uri)
        except ArgumentError:
            raise ConfigError(f"invalid --catalog-uri {config.catalog_uri!r}: expected a "
                              "SQLAlchemy URI such as sqlite:////path/catalog.db or "
                              "postgresql+psycopg://user@host/database") from None
        if url.drivername.startswith("sqlite") and url.database not in (None, "", ":memory:"):
            folder = Path(url.database).absolute().parent
            if not folder.is_dir():
                raise ConfigError(f"invalid --catalog-uri {config.catalog_uri!r}: directory "
                                  f"{str(folder)!r} does not exist")


def _check_cluster(config: StoreConfig) -> None:
    """What ``--cluster`` needs: the store's metadata and bookies on the network, and none
    of what one broker alone does for the whole store."""
    if config.lease_timeout_s is not None and config.lease_timeout_s < 2:
        raise ConfigError(f"invalid --lease-timeout {config.lease_timeout_s:g}s: at least 2s "
                          "(a broker renews its lease every second)")
    if config.metadata_url is None or not config.network_bookies:
        raise ConfigError("--cluster needs --metadata postgresql://... and --network-bookies: "
                          "every broker of the store reaches the same metadata and bookies")
    if config.takeover_after_s is not None:
        raise ConfigError("--standby is not for brokers started with --cluster: a cluster "
                          "broker takes partitions over itself")
