"""Everyday input that used to lose or misplace data with exit 0 (issue 79 §1): each is now
refused in one line naming the value, on every path a user reaches it by, with nothing
stored; or stored as meant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tierstream
from tierstream.broker.process import BrokerProcess
from tierstream.client import Admin, Producer, read
from tierstream.errors import ConfigError
from tierstream.model.positions import Offset

from .test_cli import run


def _env(broker: BrokerProcess) -> dict[str, str]:
    return {"TIERSTREAM_BROKER": broker.url or ""}


def _values(broker: BrokerProcess, topic: str) -> list[str]:
    return sorted(json.loads(line)["value"] for line in
                  run("consume", topic, env=_env(broker)).stdout.splitlines())


def test_a_topic_named_like_another_topics_partition_is_refused_everywhere(
        broker: BrokerProcess) -> None:
    """Before: ``acme/web/y-partition-1`` was created beside ``acme/web/y`` (2 partitions),
    and a Pulsar producer of that name wrote into ``y``'s partition 1."""
    env = _env(broker)
    assert run("topic", "create", "acme/web/y", "--partitions", "2", env=env).returncode == 0
    cli = run("topic", "create", "acme/web/y-partition-1", env=env)
    assert cli.returncode == 2, cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1 and "Traceback" not in cli.stderr
    assert "'acme/web/y-partition-1'" in cli.stderr and "partition 1 of topic 'acme/web/y'" \
        in cli.stderr, cli.stderr
    with Admin(broker.url) as admin:
        with pytest.raises(ConfigError, match="-partition-<number>"):
            admin.create_topic("acme/web/y-partition-7", 1)
        with pytest.raises(ConfigError, match="-partition-<number>"):  # the broker's own rule
            admin.action("create-topic", {"topic": "acme/web/new-partition-0", "partitions": 1})
        names = {t.name for t in admin.list_topics()}
    assert not {n for n in names if "-partition-" in n}, names
    # a name that only looks alike is fine
    assert run("topic", "create", "acme/web/y-partition-x", env=env).returncode == 0


def test_a_publish_time_far_ahead_is_refused_and_restamps_are_counted(
        broker: BrokerProcess) -> None:
    """Before: one message stamped 3000-01-01 was stored, and every later message of its
    partition was stamped 3000-01-01 too: invisible to any window, for good."""
    env = _env(broker)
    run("topic", "create", "acme/web/fut", env=env)
    ahead = run("produce", "acme/web/fut", env=env,
                stdin='{"value":"a","publish_time":32503680000000}\n')
    assert ahead.returncode == 2, ahead.stderr
    assert "32503680000000" in ahead.stderr and "1 hour" in ahead.stderr \
        and "--max-publish-time-ahead" in ahead.stderr, ahead.stderr
    assert "Traceback" not in ahead.stderr
    with Producer("acme/web/fut", broker=broker.url) as producer:
        producer.send("now")
        producer.send("back", publish_time=1_000)  # before the newest: restamped, counted
        with pytest.raises(ConfigError, match="ahead of the broker's clock"):
            producer.send("later", publish_time=tierstream_now() + 2 * 3_600_000)
    assert _values(broker, "acme/web/fut") == ["back", "now"]
    with Admin(broker.url) as admin:
        assert admin.topic_stats("acme/web/fut")["restamped"] == 1
    stats = run("topic", "stats", "acme/web/fut", env=env)
    assert "1 message(s) since the broker started asked for a publish time" in \
        " ".join(stats.stdout.split()), stats.stdout


def tierstream_now() -> int:
    from tierstream.util.timeutil import now_ms

    return now_ms()


def test_a_named_produce_of_other_input_is_refused_not_skipped(broker: BrokerProcess) -> None:
    """Before: the second run printed "produced 0 message(s)" and "skipped 2 message(s) that
    producer 'importer' had stored already", exit 0: its lines were never stored."""
    env = _env(broker)
    run("topic", "create", "acme/web/imp", "--partitions", "2", env=env)
    first = '{"value":"a"}\n{"value":"b","key":"k"}\n'
    assert run("produce", "acme/web/imp", "--name", "importer", stdin=first,
               env=env).returncode == 0
    other = run("produce", "acme/web/imp", "--name", "importer", env=env,
                stdin='{"value":"c"}\n{"value":"d","key":"k"}\n{"value":"e"}\n')
    assert other.returncode == 2, other.stderr
    assert "--name importer: this input is not the one stored under that name" in \
        " ".join(other.stderr.split()) and "skipped" not in other.stderr, other.stderr
    assert _values(broker, "acme/web/imp") == ["a", "b"]  # nothing of it was stored
    # the point of --name holds: a replay stores only what is missing
    grown = run("produce", "acme/web/imp", "--name", "importer", env=env,
                stdin=first + '{"value":"f"}\n')
    assert grown.returncode == 0, grown.stderr
    assert "produced 1 message(s)" in grown.stderr and "skipped 2" in grown.stderr
    shorter = run("produce", "acme/web/imp", "--name", "importer", stdin='{"value":"a"}\n',
                  env=env)
    assert shorter.returncode == 2 and "cannot be told to be a replay" in \
        " ".join(shorter.stderr.split()), shorter.stderr
    assert _values(broker, "acme/web/imp") == ["a", "b", "f"]


@pytest.mark.parametrize("value", ["7", -5, 1.5, True, "7 parsecs", "99999999999999999999d"])
def test_a_retention_the_broker_cannot_use_is_refused_on_every_path(
        broker: BrokerProcess, value: object) -> None:
    """Before: ``set_retention(t, "7")`` stored 7 ms (every closed segment deleted at the
    next pass), and a string such as ``"30d"`` broke ``topic list`` for every topic."""
    with Admin(broker.url) as admin:
        admin.create_topic("acme/web/ret", 1, exist_ok=True)
        with pytest.raises(ConfigError, match="invalid retention"):
            admin.set_retention("acme/web/ret", value)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="invalid retention"):  # the broker's own check
            admin.action("set-retention", {"topic": "acme/web/ret", "retention_ms": value})
        with pytest.raises(ConfigError, match="invalid retention"):
            admin.action("create-topic", {"topic": "acme/web/ret2", "partitions": 1,
                                          "retention_ms": value})
        assert admin.get_topic("acme/web/ret").retention_ms is None
    listing = run("topic", "list", env=_env(broker))
    assert listing.returncode == 0 and "unexpected" not in listing.stderr, listing.stderr


def test_a_retention_with_a_unit_is_taken_through_the_python_api(broker: BrokerProcess
                                                                 ) -> None:
    with Admin(broker.url) as admin:
        assert admin.create_topic("acme/web/days", 1, retention_ms="30d").retention_ms == \
            30 * 86_400_000
        assert admin.set_retention("acme/web/days", "12h").retention_ms == 12 * 3_600_000
    listing = run("topic", "list", env=_env(broker))
    assert listing.returncode == 0 and "12 hours" in listing.stdout, listing.stdout


def test_a_window_whose_end_is_before_its_start_is_refused_on_every_path(
        broker: BrokerProcess, data_dir: Path, tmp_path: Path) -> None:
    """Before: ``read --from 11-05 --to 11-04`` wrote 0 rows with exit 0, ``plan`` printed
    a plan, and the Python reads returned nothing."""
    env = _env(broker)
    run("topic", "create", "acme/web/win", env=env)
    run("produce", "acme/web/win", "--generate", "20", env=env)
    with Admin(broker.url) as admin:
        early_cut = admin.latest_cut("acme/web/win")
    run("produce", "acme/web/win", "--generate", "20", env=env)
    reversed_ = ["--from", "2026-11-05", "--to", "2026-11-04"]
    out = tmp_path / "r.parquet"
    for args in (["read", *reversed_, "--out", str(out)], ["plan", *reversed_],
                 ["backfill", *reversed_, "--out", str(tmp_path / "b")]):
        got = run(args[0], "acme/web/win", *args[1:], "--data-dir", str(data_dir), env=env)
        assert got.returncode == 2, (args, got.stderr)
        assert "ends at 2026-11-04T00:00:00.000Z, before it starts at 2026-11-05" in \
            got.stderr, (args, got.stderr)
    assert not out.exists() and not (tmp_path / "b").exists()
    later = tierstream_now()
    with pytest.raises(ConfigError, match="before it starts"):  # a time start, an earlier cut
        tierstream.read("acme/web/win", start=later, end=early_cut, broker=broker.url,
                        data_dir=str(data_dir))
    cut = tmp_path / "early.cut"
    cut.write_text(early_cut.to_json())
    got = run("read", "acme/web/win", "--from", str(later), "--to", f"@{cut}", "--out",
              str(out), "--data-dir", str(data_dir), env=env)
    assert got.returncode == 2 and "before it starts" in got.stderr, got.stderr
    with pytest.raises(ConfigError, match="before it starts"):
        read("acme/web/win", start=Offset.at_time(later), end=Offset.at_time(later - 1000),
             broker=broker.url)
    # an end equal to the start is an empty window, not a mistake
    assert tierstream.read("acme/web/win", start=early_cut, end=early_cut, broker=broker.url,
                           data_dir=str(data_dir)).num_rows == 0


def test_the_python_api_names_the_argument_of_a_mistake(broker: BrokerProcess,
                                                        data_dir: Path, tmp_path: Path) -> None:
    """Issue 79 §4: each was an exception outside tierstream's error tree (TypeError,
    AttributeError, ArrowTypeError, ArrowInvalid), or a silent fall back to the broker."""
    from tierstream.client import Consumer

    with Admin(broker.url) as admin:
        admin.create_topic("acme/web/api", 1)
    with pytest.raises(ConfigError, match="invalid topic 123"):
        tierstream.read(123, broker=broker.url)  # type: ignore[arg-type]
    for kwargs, needle in (({"partitions": 7}, "invalid partitions 7"),
                           ({"max_split_bytes": "x"}, "invalid max_split_bytes 'x'"),
                           ({"key_ranges": "x"}, "invalid number of key ranges 'x'")):
        with pytest.raises(ConfigError, match=needle):
            tierstream.plan("acme/web/api", broker=broker.url, **kwargs)
    with pytest.raises(ConfigError, match="invalid partition 'x'"):
        read("acme/web/api", partition="x", end="latest", broker=broker.url)  # type: ignore
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=r"invalid data_dir .*a file"):
        tierstream.read("acme/web/api", broker=broker.url, data_dir=str(a_file))
    with Producer("acme/web/api", broker=broker.url) as producer:
        for message, needle in (({"value": "v", "key": 7}, "message 0: key must be text"),
                                ({"value": "v", "properties": {"a": 1}},
                                 "message 0: properties must map text to text"),
                                ({"value": "v", "event_time": "yesterday"},
                                 "invalid message 0: event_time 'yesterday'"),
                                ({"value": "v", "publish_time": 1.5},
                                 "message 0: publish_time must be epoch milliseconds")):
            with pytest.raises(ConfigError, match=needle):
                producer.send_many([message])
        # a time as text is a natural way to say it: taken
        producer.send_many([{"value": "v", "event_time": "2026-11-03T00:00:00Z"}])
    with Consumer("acme/web/api", "s", broker=broker.url, initial=Offset.earliest()) as c:
        with pytest.raises(ConfigError, match="invalid timeout 'soon'"):
            c.receive(timeout="soon")  # type: ignore[arg-type]
        c.receive(timeout="1s")  # type: ignore[arg-type]  # a duration, as the CLI takes it
    # a bound as text, as tierstream.read takes it
    got = read("acme/web/api", start="2026-11-03", end="latest", broker=broker.url)
    assert sum(b.num_rows for b in got) == 1
    assert run("topic", "list", env=_env(broker)).returncode == 0
