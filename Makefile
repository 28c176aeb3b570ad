# Every target creates .venv if it is missing and installs the project into it. --no-compile:
# byte-compiling every installed module (pyspark's, botocore's) took half of a fresh install
# (54 s -> 28 s); Python compiles the few that are imported when they are.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: install demo test chaos bench lint docs clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m tierstream demo

# What CI runs (.ci/run): the linters, then the whole suite in three workers, a test file per
# worker at a time (its module fixtures and the worker's one SparkSession shared): on 2 cores
# the suite waits more than it computes (JVM starts, restarts, deadlines), and a third worker
# fills the waits (fresh clones: 12:48-14:22 against 14:30-15:50 with two). Files with slow tests
# start first (tests/conftest.py); marking the Spark CLI tests slow too put every Spark-heavy
# file at the start at once and cost 1:40 (14:28), so they are not.
test: lint docs
	$(PY) -m pytest -n 3 --dist loadfile --durations=15 -m "not chaos"

# Not in CI: >= 100 SIGKILL/restart cycles per store configuration (about 6 minutes), then
# the Spark exactly-once tests with 8 killed queries each (the suite kills the sink's once and
# leaves the file sink's, marked chaos, to this target) (~8 min), then the long versions of
# suite tests, marked chaos (a third driver on the Spark cluster).
chaos: $(STAMP)
	$(PY) -m tests.store.chaos --cycles 100
	$(PY) -m tests.store.chaos --cycles 100 --postgres
	$(PY) -m tests.store.network_chaos --faults 100
	$(PY) -m tests.store.cluster_chaos --faults 100
	$(PY) -m tests.store.client_churn --kills 1000
	$(PY) -m tests.store.subscription_chaos --messages 400000 --rounds 6
	$(PY) -m tests.store.subscription_chaos --client pulsar --messages 200000 --rounds 6
	$(PY) -m tests.store.subscription_chaos --client pulsar --routing client --modes key_shared --messages 200000 --rounds 6
	$(PY) -m tests.pulsar_wire.scale_follow
	$(PY) -m tests.pulsar_wire.scale_follow --producer pulsar
	TIERSTREAM_SPARK_KILLS=8 $(PY) -m pytest -p no:cacheprovider \
		tests/spark_adapter/test_sink.py::test_a_read_process_write_query_killed_repeatedly_writes_each_row_once \
		tests/spark_adapter/test_spark_exactly_once.py::test_sigkilled_streaming_query_restarts_exactly_once
	TIERSTREAM_FUZZ_SECONDS=120 $(PY) -m pytest -p no:cacheprovider tests/pulsar_wire/test_pulsar_fuzz.py
	TIERSTREAM_COMPACTION_ROUNDS=40 $(PY) -m pytest -p no:cacheprovider tests/pulsar_wire/test_compaction_oracle.py
	$(PY) -m pytest -p no:cacheprovider -m chaos tests/spark_adapter/test_cluster.py
	$(PY) -m pytest -p no:cacheprovider -m chaos tests/store/test_network_namespaces.py \
		-k "lapsed_and_was_renewed or reader_cut_off"

bench: $(STAMP)
	$(PY) -m bench all

# The user guide (docs/, mkdocs.yml) into build/site; a warning (a broken link, a page left
# out of the navigation) fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench docs_hooks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis bench/results build
