"""The Python half of issue 79 §6's guard: every public Python entry (``tierstream.read`` and
its kin, the clients and their methods) given a table of wrong values in each of its
arguments, the cases generated from the signatures so that an argument is covered the day it
is added. Each case is taken (the value means something) or raises an error of tierstream's
tree naming the argument or the value; never a TypeError, AttributeError... from deep inside,
never a call that hangs. Afterwards no topic was created by a refused call, and the store
still serves.

Before: ``Producer(batch_size='x')`` raised TypeError, ``Producer(schema=7)`` TypeError and
``IndexError``, ``Consumer(initial='earliest')`` AttributeError, ``client.read(key_ranges=7)``
TypeError, ``plan(reader=7)`` AttributeError, ``scan(parallelism='x')`` TypeError."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import tierstream as ts
from tierstream import client
from tierstream.errors import TierstreamError
from tierstream.read_options import ReadOptions

from .logs import TOPIC, Log, append, running_log
from .timing import scaled

#: wrong values every argument gets: other types, out of range, malformed text, odd bytes
WRONG: tuple[Any, ...] = (7, -1, 0, "bogus", "", b"\xff", ["x"], {"a": object()}, 10**20, 1.5,
                          float("nan"), object(), True)
#: arguments not under test: where the broker is and how to reach it (their own tests)
SKIPPED = {"self", "broker", "auth_token", "tls_ca", "data_dir", "options", "kwargs"}


def _params(*functions: Callable[..., Any]) -> list[str]:
    """The arguments of ``functions`` that a caller names (keyword or positional)."""
    names: list[str] = []
    for f in functions:
        for name, p in inspect.signature(f).parameters.items():
            if name not in SKIPPED and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) \
                    and name not in names:
                names.append(name)
    return names


def _entries(log: Log, closing: contextlib.ExitStack, created: set[str]
             ) -> Iterator[tuple[str, list[str], Callable[..., Any]]]:
    """(name, arguments, call taking those arguments as keywords) of each public entry;
    ``call`` fills in good values for the arguments it is not given. A topic that a call
    created goes into ``created``."""
    at: dict[str, Any] = {"broker": log.url}
    bounded = {"end": "latest", **at}

    def with_defaults(defaults: dict[str, Any], fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda **given: fn(**{**defaults, **given})

    def consume(topic: str = TOPIC, subscription: str = "guard", **kw: Any) -> None:
        with client.Consumer(topic, subscription, **kw) as consumer:
            consumer.receive(timeout=0)

    def produce(topic: str = TOPIC, **kw: Any) -> None:
        client.Producer(topic, **kw).close()

    def topic_reader(topic: str = TOPIC, **kw: Any) -> None:
        with client.read(topic, **kw) as reader:
            for _ in reader:
                pass

    read_args = _params(ReadOptions.from_kwargs, ts.scan)
    yield "tierstream.plan", _params(ts.plan), with_defaults({"topic": TOPIC, **bounded}, ts.plan)
    yield "tierstream.read", read_args, with_defaults({"topic": TOPIC, **bounded}, ts.read)
    yield "tierstream.scan", read_args, with_defaults(
        {"topic": TOPIC, **bounded}, lambda **kw: list(ts.scan(**kw)))
    yield "tierstream.latest_cut", _params(ts.latest_cut), with_defaults(
        {"topic": TOPIC, **at}, ts.latest_cut)
    yield "client.read", _params(client.read), with_defaults(bounded, topic_reader)
    yield "client.Producer", _params(client.Producer), with_defaults(at, produce)
    yield "client.Consumer", _params(client.Consumer), with_defaults(at, consume)
    yield "client.Admin", _params(client.Admin), with_defaults(
        at, lambda **kw: client.Admin(**kw).close())
    yield "client.Transaction", _params(client.Transaction), with_defaults(
        at, lambda **kw: client.Transaction(**kw).abort())
    producer = closing.enter_context(client.Producer(TOPIC, **at))
    consumer = closing.enter_context(client.Consumer(TOPIC, "guard-receive", **at))
    admin = closing.enter_context(client.Admin(log.url))
    yield "Producer.send", _params(client.Producer.send), with_defaults(
        {"value": "v"}, producer.send)
    yield "Producer.send_many", _params(client.Producer.send_many), producer.send_many
    yield "Producer.send_many(message)", ["value", "key", "event_time", "properties",
                                          "publish_time", "sequence_id"], \
        lambda **kw: producer.send_many([{"value": "v", **kw}])
    yield "Consumer.receive", _params(client.Consumer.receive), consumer.receive
    def create(topic: str | None = None, partitions: int = 1, **kw: Any) -> None:
        topic = f"acme/guard/new-{next(fresh)}" if topic is None else topic
        admin.create_topic(topic, partitions, **kw)
        created.add(topic)  # the call took its value

    fresh = itertools.count()
    yield "Admin.create_topic", _params(client.Admin.create_topic), create
    yield "Admin.set_retention", _params(client.Admin.set_retention), with_defaults(
        {"topic": TOPIC, "retention_ms": "7d"}, admin.set_retention)
    yield "Admin.set_partitions", _params(client.Admin.set_partitions), with_defaults(
        {"topic": TOPIC, "partitions": 1}, admin.set_partitions)


def _names_of(name: str, value: Any) -> tuple[str, ...]:
    """How an error may name the argument: as written, in words, as the options table
    (shared with the CLI and Spark) has it (``valueFormat``), one element of a list
    ("message 3" of ``messages``), or by its value."""
    first, *rest = name.split("_")
    return (name, name.replace("_", " "), first + "".join(w.title() for w in rest),
            f"{name.removesuffix('s')} ", repr(value), str(value))


def _outcome(call: Callable[[], Any]) -> BaseException | str | None:
    """What ``call`` raised, None if it returned, "hung" if it ran past its limit."""
    box: dict[str, BaseException | str | None] = {}

    def run() -> None:
        try:
            call()
            box["got"] = None
        except BaseException as exc:
            box["got"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(scaled(20))
    return box.get("got", "hung")


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Log]:
    with running_log(tmp_path_factory.mktemp("every-argument")) as running:
        running.store.create_topic(TOPIC, 1)
        append(running.store, 0, ["a", "b"], keys=["k", None], times=[1_793_491_200_000, None])
        yield running


def test_every_argument_given_a_wrong_value_is_taken_or_refused_by_name(log: Log) -> None:
    with contextlib.ExitStack() as closing:
        failures, cases, created = _run_every_case(log, closing)
    assert cases > 500, cases
    assert not failures, f"{len(failures)} of {cases} cases:\n" + "\n".join(failures)
    with client.Admin(log.url) as admin:  # nothing made by a refused call; it still serves
        assert {t.name for t in admin.list_topics()} <= {TOPIC, *created}
    assert ts.read(TOPIC, end="latest", broker=log.url).num_rows >= 2


def _run_every_case(log: Log, closing: contextlib.ExitStack
                    ) -> tuple[list[str], int, set[str]]:
    """(what went wrong, how many cases, topics that a call taking its value created)."""
    failures: list[str] = []
    cases, created = 0, set[str]()
    for entry, names, call in _entries(log, closing, created):
        assert names or entry == "Producer.send_many", entry
        for name in names:
            for value in WRONG:
                cases += 1
                got = _outcome(lambda: call(**{name: value}))  # noqa: B023 - run at once
                where = f"{entry}({name}={value!r})"
                if got is None:
                    continue
                if got == "hung":
                    failures.append(f"{where}: still running after {scaled(20):.0f} s")
                elif not isinstance(got, TierstreamError):
                    failures.append(f"{where}: {type(got).__name__}: {got}")
                elif not any(n in str(got) for n in _names_of(name, value)):
                    failures.append(f"{where}: does not name it: {got}")
    return failures, cases, created


def test_the_guard_covers_what_it_says(log: Log) -> None:
    """An argument added to an entry is in the table the day it is added."""
    with contextlib.ExitStack() as closing:
        covered = {entry: names for entry, names, _ in _entries(log, closing, set())}
    assert "batch_size" in covered["client.Producer"]
    assert "initial" in covered["client.Consumer"]
    assert {"parallelism", "reader", "fail_on_data_loss"} <= set(covered["tierstream.read"])
