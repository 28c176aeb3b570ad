"""The public API: the names the package root exports, pinned."""

from __future__ import annotations

import tierstream

from .timing import scaled


def test_public_names_are_pinned() -> None:
    assert sorted(tierstream.__all__) == sorted([
        "MESSAGE_SCHEMA", "READ_SCHEMA", "AckInDoubtError", "AlreadyExistsError", "AuthError",
        "ConfigError",
        "ConflictError", "CorruptionError", "DataLossError", "KeyRange", "NotFoundError",
        "Offset", "Position",
        "ProtocolError", "ReadOptions", "ReaderKind", "Split", "StorageError", "StreamCut",
        "TierstreamError", "TopicName", "UnavailableError", "__version__", "key_hash",
        "latest_cut", "plan", "read", "scan", "tail",
    ])
    for name in tierstream.__all__:
        assert hasattr(tierstream, name)


def test_the_python_api_takes_the_spark_source_options(tmp_path) -> None:
    from .logs import BASE, TOPIC, fill, running_log

    with running_log(tmp_path / "data") as log:
        fill(log, partitions=2, batches=4, keys=5)
        options = {"topic": TOPIC, "dataDir": str(log.data_dir), "broker": log.url,
                   "startingTime": str(BASE + 60_000), "keyRanges": "2"}
        by_options = tierstream.read(options=options)
        by_kwargs = tierstream.read(TOPIC, start=BASE + 60_000, key_ranges=2, **log.kw())
        assert by_options.num_rows == by_kwargs.num_rows > 0
        assert sorted(by_options.column("value").to_pylist()) == sorted(
            by_kwargs.column("value").to_pylist())
        parsed = tierstream.ReadOptions.parse(options)
        assert len(tierstream.plan(options=parsed)) == len(tierstream.plan(options=options))
        assert "authToken" not in repr(parsed) and "auth_token" not in repr(parsed)


def test_importing_tierstream_does_not_import_pyspark() -> None:
    # Regression: the readers' stats module imported pyspark (~60 ms) for every CLI command
    # and every Python user; only the Spark adapter needs it.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import sys, tierstream, "
                           "tierstream.runtime.local, tierstream.readers.stats; "
                           "print('pyspark' in sys.modules)"],
                          capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_the_version_is_the_projects() -> None:
    """One version: pyproject.toml's, as the package, the CLI and the broker say it."""
    import tomllib
    from pathlib import Path

    import tierstream
    from tierstream.util.version import VERSION

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert tierstream.__version__ == VERSION == project["project"]["version"]
