# `make demo` runs the daemon with its demo model and shows it answering;
# `make test` installs what the tests need and runs them. Both create .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs docs-check proto bench bench-formats bench-shapes bench-many bench-perf-analyzer bench-canary bench-curve bench-compare bench-priority bench-reload bench-restart bench-soak bench-steps bench-groups bench-pipelines sim clean

$(PY):
	# System site-packages stay visible so a GPU machine's own torch build is used.
	$(PYTHON) -m venv --system-site-packages $(VENV)

# What the daemon needs, for the demo; the test tools come on top. (Only the tools' kubernetes asks for newer
# dateutil and pydantic than some system packages visible through --system-site-packages, which pip reports
# as an ERROR line: the demo does not install it.)
# torch==2.13.0 only where none is importable: the CPU build where pip finds a local CPU wheel; from PyPI on
# Linux x86-64 it is the multi-GB CUDA build (docs/getting-started.md says how to get the CPU one).
# Then the torch found or installed is pinned in $(CONSTRAINTS), which every install into the venv takes
# (`.venv/bin/pip install -c .venv/constraints.txt torchvision`): pip would otherwise replace it with whatever
# torch a new package asks for, on Linux x86-64 PyPI's CUDA build and its NVIDIA libraries.
CONSTRAINTS := $(VENV)/constraints.txt
$(CONSTRAINTS): | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

RUNTIME := $(VENV)/.installed-runtime
$(RUNTIME): pyproject.toml | $(CONSTRAINTS)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e .
	touch $(RUNTIME)

# The test tools come with the runtime in one install (not after it: a second build of the package).
$(STAMP): pyproject.toml | $(CONSTRAINTS)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $(RUNTIME) $(STAMP)

THIRD_PARTY := $(VENV)/.third-party
# Triton's perf_analyzer and KServe's SDK: clients others wrote, which the OIP tests run (tests/third_party.py).
$(THIRD_PARTY): tests/third_party.py | $(PY)
	$(PY) tests/third_party.py install $(VENV)
	touch $(THIRD_PARTY)

lint: $(STAMP)
	$(PY) -m ruff check inferd tests bench deploy
	$(PY) -m mypy

demo: $(RUNTIME)
	$(PY) -m inferd.demo run

# The third-party tools install beside the venv's own packages and the linters: neither needs the other.
test:
	$(MAKE) --no-print-directory -j2 lint $(THIRD_PARTY)
	# Three test files at a time (on two cores: a file waiting on a daemon leaves its core to the others),
	# then the few tests that measure CPU or time or use fixed ports, alone.
	$(PY) -m pytest -q -n 3 --dist loadfile -m "not serial"
	$(PY) -m pytest -q -p no:xdist -m serial

bench: $(STAMP)
	$(PY) -m bench.run
	$(PY) -m bench.shm_echo
	$(PY) -m bench.formats

# TorchScript, torch.export and AOTInductor of the mlp and the cnn, in-process and through inferd (minutes: it compiles).
bench-formats: $(STAMP)
	$(PY) -m bench.formats

# Sequences of many lengths batched by exact shape, padded to max_shape, and padded to shape buckets.
bench-shapes: $(STAMP)
	$(PY) -m bench.shapes

# 40 on-demand models of ~30 MB under a budget that holds 8, Zipf traffic, beside all 40 loaded (about 3 minutes).
bench-many: $(STAMP)
	$(PY) -m bench.many

# max_wait_ms 0, 2, 5 and "auto", concurrency 1..128, per model (about 3 minutes each).
bench-curve: $(STAMP)
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[bench]"
	$(PY) -m bench.curve --model mlp
	$(PY) -m bench.curve --model cnn

# inferd beside TorchServe, LitServe and Ray Serve: the benchmark mlp over each one's HTTP API, C=1..64, each
# server three times (about 8 minutes; the first run installs the three, some 300 MB, into the venv: the `compare` extra).
bench-compare: $(STAMP)
	$(PY) -c "import matplotlib, ts, litserve, ray.serve" 2>/dev/null || $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[compare]"
	$(PY) -m bench.compare --rounds 3

# Triton's perf_analyzer beside inferd's own load generator, HTTP and gRPC, C=1, 8 and 64 (about 3 minutes).
bench-perf-analyzer: $(STAMP) $(THIRD_PARTY)
	$(PY) -m bench.perf_analyzer

# An urgent and a default-level client at 3x capacity for 30 s (about a minute in all).
bench-priority: $(STAMP)
	$(PY) -m bench.priority

bench-reload: $(STAMP)
	$(PY) -m bench.reload

# A crashed worker's replacement, timed, beside a fresh interpreter's import of torch.
bench-restart: $(STAMP)
	$(PY) -m bench.restart --rounds 3

bench-canary: $(STAMP)
	$(PY) -m bench.reload --canary

bench-soak: $(STAMP)
	$(PY) -m bench.soak

# A Python model's cost beside a tensor model's, and a CPU-bound one's throughput with one process and two.
bench-steps: $(STAMP)
	$(PY) -m bench.steps

# The mlp at C=64 over ZeroMQ, a request per message against groups, beside the model in-process (issue 53).
bench-groups: $(STAMP)
	$(PY) -m bench.wire_groups

# The image pipeline at C=1 and C=32 against its steps chained in-process and by the client over HTTP, and a
# balanced pipeline (a 5 ms CPU step, a 5 ms model step) against its steps in-process (docs/performance.md).
bench-pipelines: $(STAMP)
	$(PY) -m bench.pipelines

# The fleet simulation (deploy/sim/README.md): 16, 64 and 256 nodes, both GPU-sharing modes, the default
# scheduler and inferd-fleet, a simulated day each (under a minute in all).
sim: $(STAMP)
	$(PY) -m deploy.sim.run

# The gRPC messages, from inferd/oip/inference.proto (the generated code is checked in).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iinferd/oip --python_out=inferd/oip --pyi_out=inferd/oip inferd/oip/inference.proto

# The documentation site (mkdocs.yml, docs/) into build/site: the config reference regenerated, then a strict
# build, which fails on a broken link or anchor. docs-check, which CI runs, rewrites nothing: a stale reference fails.
DOCS_TOOLS := $(VENV)/.docs-tools
$(DOCS_TOOLS): pyproject.toml | $(STAMP)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[docs]"
	touch $(DOCS_TOOLS)

docs: $(DOCS_TOOLS)
	$(PY) -m inferd.config --update docs/reference/config.md
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-check: $(DOCS_TOOLS)
	$(PY) -m inferd.config --check docs/reference/config.md
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info
