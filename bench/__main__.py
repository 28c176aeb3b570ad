"""``python -m bench NAME... | all [--full | --tiny]``: run benchmarks, print tables, write
results."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench import (
    brokers_bench,
    compaction_bench,
    delayed_bench,
    elastic_bench,
    flames,
    framework_bench,
    harness,
    history,
    instructions,
    keyed_bench,
    latency_fs_bench,
    metadata_bench,
    pulsar_bench,
    remote_bench,
    remote_bookie_bench,
    remote_write_bench,
    schema_bench,
    sink_bench,
    spark_bench,
    store_bench,
    subscription_bench,
    tier_bench,
    tier_cache_bench,
)

BENCHMARKS: dict[str, tuple[Callable[[bool], Path], str]] = {
    "produce": (store_bench.produce, "produce throughput into one partition, fsync on, beside "
                                     "append+fdatasync of the same bytes"),
    "tail": (store_bench.tail, "produce -> consume latency percentiles at 10,000 msg/s"),
    "consume": (store_bench.consume, "consume throughput through the broker beside the Flight "
                                     "transport serving the same batches from memory"),
    "subscriptions": (subscription_bench.subscriptions, "4 shared / 4 key_shared consumers "
                      "beside 1 exclusive (msg/s, acks/s); a key_shared join: first message, "
                      "the others' longest pause"),
    "plan": (framework_bench.plan, "planning a one-hour window, binary search vs a linear scan, "
                                   "and time vs segments per partition"),
    "readers": (framework_bench.readers, "bookie-log and parquet-tier readers beside pyarrow "
                                         "reading the same bytes"),
    "keyranges": (framework_bench.keyranges, "read amplification and speed-up of k key ranges "
                                             "over tiered data"),
    "spark": (spark_bench.spark, "Spark backfill (noop sink) over tiered and bookie data beside "
                                 "spark.read.parquet of the same files; keyRanges"),
    "remote": (remote_bench.remote, "parquet-tier reader over S3 (moto) with 0/10/50 ms per "
                                    "request, beside local files"),
    "remote-fs": (latency_fs_bench.remote_fs, "parquet-tier reader over local files behind a "
                  "modelled network (0/10/50 ms + 100 MB/s per request), beside local files"),
    "tier-cache": (tier_cache_bench.tier_cache, "a window of tier files through S3 (moto, "
                   "10 ms + 100 MB/s per request): no cache, into an empty one, again from a "
                   "full-window and a half-window cache, a Spark backfill sharing it; beside "
                   "local files, S3 GETs counted"),
    "remote-bookie": (remote_bookie_bench.remote_bookie, "bookie-log reader over a bookie "
                      "endpoint beside local files; key-range wire amplification"),
    "remote-write": (remote_write_bench.remote_write, "produce msg/s with 3 network bookies "
                     "(wq3/aq2, processes) beside 3 local bookie directories, same run"),
    "re-replication": (remote_write_bench.re_replication, "MB/s (and s per GB) until a lost "
                       "bookie's copies are whole again (3 network bookies, --replace) beside "
                       "an fsync'd copy of the same files"),
    "brokers": (brokers_bench.brokers, "produce / consume msg/s with 1, 2 and 3 brokers "
                "serving one store (--cluster) and CPU per message per broker; partition move "
                "time p50/p99 after a SIGKILL, beside the lease timeout"),
    "offload": (tier_bench.offload, "offload MB/s to file:// and moto S3 beside a plain "
                                    "Parquet write; Parquet vs bookie bytes"),
    "catalog": (tier_bench.catalog, "ms to register one more tier file in Iceberg, early and "
                                    "after N files, beside pyiceberg add_files defaults"),
    "sink": (sink_bench.sink, "Spark batch write through two-phase commit beside the Python "
                              "producer on the same rows; ms per micro-batch commit"),
    "schema": (schema_bench.schema, "decoding typed values (Avro, JSON) beside the codec "
                                    "library alone; Spark valueFormat=auto beside raw"),
    "elastic": (elastic_bench.elastic, "reading a window across a 2 -> 8 scale event beside "
                                       "the same messages in a never-scaled topic"),
    "pulsar-produce": (pulsar_bench.pulsar_produce, "the real pulsar-client's async batched "
                       "produce (1 and 4 partitions) beside tierstream's own Producer; the "
                       "broker's decode of Pulsar batches alone"),
    "compaction": (compaction_bench.compaction, "a Spark read of each key's latest value from "
                   "the compaction snapshot beside reading everything and keeping each key's "
                   "last; the compactor beside pq.write_table of the same messages"),
    "pulsar-consume": (pulsar_bench.pulsar_consume, "real pulsar-client consumers (1 exclusive, "
                       "4 shared, 4 key_shared; processes) receive + ack beside tierstream's "
                       "own Consumer"),
    "metadata": (metadata_bench.metadata, "metadata hot paths (roll, ack flush, de-dup save, "
                 "plan) and produce / consume through a broker, PostgreSQL beside SQLite"),
    "delayed": (delayed_bench.delayed, "delayed delivery: lateness of messages due at random "
                "over 10 s (p50/p99), and the drain rate of held messages once due beside "
                "unheld ones (2 shared consumers)"),
    "keyed": (keyed_bench.keyed, "the broker's CPU per message to produce and consume "
              "(acking each batch) with 1,000 distinct keys per batch, beside the same "
              "messages without keys"),
    "layout": (tier_bench.layout, "bytes a k=4 key-range read and a 10% time window fetch, "
                                  "key-bucket layout vs log order"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="tierstream benchmarks; each prints a table and writes "
                    "bench/results/<name>.json (see bench/README.md).",
        epilog="benchmarks:\n" + "\n".join(f"  {k:10s} {doc}" for k, (_, doc) in
                                          BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", nargs="+", choices=[*BENCHMARKS, "all"],
                        help="benchmarks to run, or all")
    parser.add_argument("--full", action="store_true", help="the larger profile (slower)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny inputs, one run each: check that the benchmarks run (their "
                             "figures mean nothing; results go to a temporary directory)")
    parser.add_argument("--against", metavar="REV", default=None,
                        help="run the benchmark on this tree and at git revision REV in "
                             "alternating rounds, and compare their ratios; with "
                             "--instructions, count the broker at REV beside this tree's")
    parser.add_argument("--instructions", action="store_true",
                        help="the broker's instructions per message on the paths named ("
                             f"{', '.join(instructions.PATHS)}), counted under valgrind's "
                             "callgrind: a figure load does not move (~1.5 min for all four)")
    parser.add_argument("--flame", action="store_true",
                        help="a flame graph of the broker's CPU on each path named (as "
                             "--instructions), sampled by py-spy: bench/results/flame-NAME.svg")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds with --against (default 4, 8 with --full)")
    args = parser.parse_args(argv)
    names = list(BENCHMARKS) if "all" in args.name else list(dict.fromkeys(args.name))
    if args.tiny:
        if args.full or (args.against is not None and not args.instructions):
            parser.error("--tiny takes neither --full nor --against (but --instructions "
                         "--against)")
        print(f"tiny profile: results in {harness.use_tiny_profile()}", file=sys.stderr)
    if args.instructions or args.flame:
        flag = "--instructions" if args.instructions else "--flame"
        if (args.flame and args.against is not None) or "all" in args.name or (
                args.instructions and args.flame):
            parser.error(f"{flag} takes neither all nor the other of --instructions and "
                         "--flame" + ("" if args.instructions else ", nor --against"))
        if other := [n for n in names if n not in instructions.PATHS]:
            parser.error(f"{flag} is for {', '.join(instructions.PATHS)}, not "
                         f"{', '.join(other)}")
        try:
            if args.flame:
                flames.flames(names, not args.full)
            else:
                instructions.instructions(names, not args.full, args.against)
        except Exception as exc:  # one line (valgrind or py-spy missing, a path failed)
            print(f"{flag} failed: {exc}", file=sys.stderr)
            if harness.TINY:  # a check of the benchmarks themselves: show where
                traceback.print_exc()
            return 1
        return 0
    if args.against is not None:
        if len(names) != 1:
            parser.error("--against takes one benchmark, not several")
        history.against(names[0], args.against, not args.full, args.rounds)
        return 0
    failed = []
    for name in names:
        began = time.monotonic()
        try:
            BENCHMARKS[name][0](not args.full)
            print(f"benchmark {name}: {time.monotonic() - began:,.0f} s", file=sys.stderr)
        except Exception as exc:  # report and go on with the others
            print(f"benchmark {name} failed: {exc}", file=sys.stderr)
            if harness.TINY:  # a check of the benchmarks themselves: show where
                traceback.print_exc()
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
