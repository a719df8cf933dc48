# Two commands do all the setup on a fresh machine: `make run` (the broker and its tools) and
# `make test` (those plus the test extras: pytest, Spark, Playwright, Debian's chromium, and rhea).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run

HOST ?= 127.0.0.1
PORT ?= 5672
MGMT_PORT ?= 8672
# make run DATA_DIR=DIR: qflowd's --data-dir (default: ~/.qflowd), e.g. for a second broker beside the first
DATA_DIR ?=

.PHONY: run test test-repeat fuzz install lint interop bench bench-smoke bench-compare bench-amqp bench-store bench-spark soak \
	console-screenshot bench-console clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall when the packaging or the C sources change.
# native/qflow_shared.h is written from qflow/broker/ops.py at build time (native/shared_header.py).
INSTALL_DEPS := $(PY) pyproject.toml setup.py $(wildcard native/*.c native/*.h native/build_*.py) \
	native/shared_header.py qflow/broker/ops.py
CHECK_NATIVE := $(PY) -c "import qflow._accounting_native, qflow._transfers_native, qflow._journal_native, qflow._amqp_native"

# The test install: qflow with the extra test (pytest, prometheus_client, pyspark, playwright...).
$(STAMP): $(INSTALL_DEPS)
	$(PY) -m pip install --quiet -e '.[test]'
	$(CHECK_NATIVE)
	touch $(STAMP)

# The broker's install: qflow and its tools, no extras. A test install at least as new as the
# packaging has it all already: then nothing is installed.
$(RUN_STAMP): $(INSTALL_DEPS)
	@if [ -f $(STAMP) ] && [ -z "$$(find $(filter-out $(PY),$^) -newer $(STAMP))" ]; then \
		echo "$(STAMP) is up to date: the test install includes the broker's"; \
	else \
		echo "$(PY) -m pip install --quiet -e ."; \
		$(PY) -m pip install --quiet -e . && $(CHECK_NATIVE); \
	fi
	touch $(RUN_STAMP)

# The browser the cross-origin test drives (tests/test_browser_attack.py): Debian's chromium, installed
# with apt-get (as root) when missing; Playwright's own browser download is never used.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

# rhea, the JavaScript AMQP 1.0 client the tests run against qflowd (tests/test_amqp_rhea.py), pinned,
# into the venv's own node directory (never the checkout); Node itself is the machine's (/usr/bin/node).
RHEA_VERSION := 3.0.5
RHEA := $(VENV)/node/node_modules/rhea/package.json
$(RHEA): | $(PY)
	npm install --prefix $(VENV)/node --no-save --no-audit --no-fund --no-package-lock rhea@$(RHEA_VERSION)
	@grep -q '"version": "$(RHEA_VERSION)"' $(RHEA) || (echo "rhea $(RHEA_VERSION) not installed" && exit 1)
	touch $(RHEA)

install: $(RUN_STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/qflowd --host $(HOST) --port $(PORT) --mgmt-port $(MGMT_PORT)$(if $(DATA_DIR), --data-dir '$(DATA_DIR)')

# The benchmarks' smoke run first (so they never rot), then the whole suite once
# per accounting implementation; pytest's summary is the last line.
test: $(STAMP) $(RHEA) | $(CHROMIUM)
	$(PY) bench/run.py --smoke
	QFLOW_ACCOUNTING=native $(PY) -m pytest
	QFLOW_ACCOUNTING=python $(PY) -m pytest -m "not native_only"

# Flakiness check: the suite N times, JOBS at once; lists every test that failed at least once.
N ?= 10
JOBS ?= 1
test-repeat: $(STAMP) $(RHEA) | $(CHROMIUM)
	$(PY) tools/test_repeat.py -n $(N) --jobs $(JOBS)

# The differential and model Hypothesis tests, over and over with a fresh seed each round and FUZZ_SCALE
# times make test's examples, for FUZZ_MINUTES (tools/fuzz.py); prints every failing seed and its replay.
FUZZ_MINUTES ?= 30
FUZZ_SCALE ?= 20
fuzz: $(STAMP)
	$(PY) tools/fuzz.py --minutes $(FUZZ_MINUTES) --scale $(FUZZ_SCALE)

lint: $(STAMP)
	$(PY) -m ruff check qflow cli tests bench native tools

bench: $(STAMP)
	$(PY) bench/run.py

bench-smoke: $(STAMP)
	$(PY) bench/run.py --smoke

# The Spark data source's throughput beside the broker alone (bench/spark.py); SPARK_BENCH_ARGS=--quick: seconds
bench-spark: $(STAMP)
	$(PY) bench/spark.py $(SPARK_BENCH_ARGS)

# A bounded soak (about 3 min, bench/soak.py): 1000 connections, producers, consumers, a slow consumer
# cycling flow control, a bulk purge and delete, idle connections; RSS, the probe's worst wait, messages
# lost (exits 1 if any). Not part of make test. Options: make soak SOAK_ARGS='--duration 30'
SOAK_ARGS ?=
soak: $(STAMP)
	$(PY) bench/soak.py $(SOAK_ARGS)

# Side by side with RabbitMQ (bench/README.md). Installs Debian's rabbitmq-server with apt-get if missing
# (root). The AMQP client libraries go into the venv for the benchmark only: they are not qflow dependencies.
# Its latency workload runs beside qpidd instead, built once by ../shared/anchors/build-qpidd.sh into
# QPID_BUILD (about 10 min on 2 cores; apt-get, root); without one it is skipped.
# Options: make bench-compare COMPARE_ARGS=--quick; only the latency beside qpidd: COMPARE_ARGS='--workloads latency'
QPID_BUILD ?= $(HOME)/.cache/qflow-anchors/qpid-cpp
ANCHORS ?= ../shared/anchors
bench-compare: $(STAMP)
	$(PY) -m pip install --quiet 'pika>=1.3' 'aio-pika>=9' 'amqp>=5.2'
	@if [ -x $(ANCHORS)/build-qpidd.sh ]; then $(ANCHORS)/build-qpidd.sh $(QPID_BUILD) || echo "qpidd not built: the latency workload is skipped"; fi
	$(PY) bench/compare --qpid-build $(QPID_BUILD) $(COMPARE_ARGS)

# The Apache Qpid Interop Test (QIT 2.0) against qflowd: its python-proton and rhea shims (tools/interop.py,
# about 3 min). QIT is built once from its snapshot in ANCHORS into QIT (its own venv with python-qpid-proton,
# the rhea shim's node_modules: nothing of it goes into qflow's venv). Options: INTEROP_ARGS='--parts types'
QIT_SNAPSHOT := qpid-interop-test-b8b89adf
QIT ?= $(HOME)/.cache/qflow-anchors/$(QIT_SNAPSHOT)
INTEROP_ARGS ?=
$(QIT)/.built: $(ANCHORS)/$(QIT_SNAPSHOT).tar.xz
	rm -rf $(QIT) $(QIT).tmp && mkdir -p $(QIT).tmp
	tar xJf $< -C $(QIT).tmp && mv $(QIT).tmp/qpid-interop-test $(QIT) && rmdir $(QIT).tmp
	$(PYTHON) -m venv $(QIT)/.venv
	$(QIT)/.venv/bin/pip install --quiet 'python-qpid-proton==0.40.0' 'click>=8.1' 'pydantic>=2' \
		'pydantic-settings>=2' 'rich>=13' 'pytest>=8' 'pytest-timeout>=2.2' 'pytest-xdist>=3.5' 'hypothesis>=6.100'
	npm install --prefix $(QIT)/shims/javascript-rhea --no-save --no-audit --no-fund --no-package-lock \
		rhea@$(RHEA_VERSION)
	touch $@

interop: $(STAMP) $(QIT)/.built
	$(PY) tools/interop.py --qit $(QIT) $(INTEROP_ARGS)

# qflowd beside qpidd over AMQP 1.0 with the same clients on both (bench/amqp_throughput.py): qpid-send/qpid-receive
# and proton pairs, 64 B and 1 KiB, interleaved, each broker's CPU per message. qpidd and the tools are built once by
# ../shared/anchors/build-qpidd.sh into QPID_BUILD (returns at once when built). Options: AMQP_BENCH_ARGS='--rounds 5',
# '--tools-cap' (what qpid-send and qpid-receive do alone), '--base DIR' (another tree's qflowd beside: before/after)
AMQP_BENCH_ARGS ?=
bench-amqp: $(STAMP)
	bash $(ANCHORS)/build-qpidd.sh $(QPID_BUILD)
	$(PY) bench/amqp_throughput.py --qpid-build $(QPID_BUILD) $(AMQP_BENCH_ARGS)

# The durable store's engine candidates side by side, no broker (bench/store_engines.py, docs/store.md).
# lmdb and crc32c (the extra store-bench) go into the venv for this benchmark only.
# Options: make bench-store STORE_ARGS=--quick (seconds); the figures in docs/store.md: STORE_ARGS='--reps 5 --probe'
STORE_ARGS ?= --probe
bench-store: $(STAMP)
	$(PY) -m pip install --quiet 'lmdb>=1.4' 'crc32c>=2.3'
	$(PY) bench/store_engines.py $(STORE_ARGS)

# What the console's feed costs (bench/console.py): a snapshot's build time by queue count, and a
# producer/consumer pair's throughput with and without 4 consoles open. Options: CONSOLE_ARGS=--quick
CONSOLE_ARGS ?=
bench-console: $(STAMP)
	$(PY) bench/console.py $(CONSOLE_ARGS)

# docs/console.png, the web console with a queue flow-stopped (tools/console_screenshot.py: its own qflowd,
# the README's producer, headless Chromium). Not part of make test: the tests never write into the checkout.
console-screenshot: $(STAMP) | $(CHROMIUM)
	$(PY) tools/console_screenshot.py docs/console.png

clean:
	rm -rf $(VENV) build *.egg-info qflow/_accounting_native*.so qflow/_transfers_native*.so qflow/_journal_native*.so
