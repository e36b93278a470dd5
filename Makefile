# hsx: `make demo` runs an extraction on this machine; `make test` runs every test.
# Both set themselves up from nothing. Caches that are safe to lose live under $(HSX_CACHE).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
HSX_CACHE ?= $(HOME)/.cache/hsx
UV_VERSION := 0.13.9
UV_HOME := $(HSX_CACHE)/uv-$(UV_VERSION)
UV := $(UV_HOME)/bin/uv
VENV := .venv
BIN := $(VENV)/bin
export SSL_CERT_FILE ?= /etc/ssl/certs/ca-certificates.crt
export HSX_CACHE
export PYTHONUNBUFFERED := 1

.PHONY: help venv test-tools lint test fuzz demo dev-cluster dev-bucket images bench crds clean

help:
	@echo "make demo         extract a bundled dataset with a tiny model on CPU, verify, summarise"
	@echo "make test         lint, type-check and run every test (builds test binaries once, cached)"
	@echo "make dev-cluster  start the test control plane + node agent + S3 server in the foreground"
	@echo "make dev-bucket NAME=b  make a bucket on the running dev cluster's S3 server"
	@echo "make images REGISTRY=r [PUSH=1]  build (and push) the operator, extractor, sglang and vllm images"
	@echo "make fuzz         the fuzz properties of every input surface, long budget (make test runs a short one)"
	@echo "make bench        run the benchmarks under bench/ (results in bench/results/)"
	@echo "make crds         regenerate crds/ from the operator's pydantic models"

$(UV):
	$(PYTHON) -m venv $(UV_HOME)
	$(UV_HOME)/bin/pip install -q uv==$(UV_VERSION)

# uv hard-links from its cache, so a fresh venv with torch takes seconds once the cache is warm.
$(VENV)/.installed: pyproject.toml | $(UV)
	$(UV) venv -q --allow-existing -p $(PYTHON) $(VENV)
	$(UV) pip install -q -p $(BIN)/python -e '.[extractor,operator,reference,dev]'
	touch $@

# The native bf16 kernels (storage/native.py), beside their source where the editable install finds them.
NATIVE_LIB := extractor/hsx_extractor/storage/_hsx_bf16.so
$(NATIVE_LIB): extractor/hsx_extractor/storage/bf16_kernels.c extractor/hsx_extractor/storage/native.py $(VENV)/.installed
	$(BIN)/python -m hsx_extractor.storage.native build $(@D)

venv: $(VENV)/.installed $(NATIVE_LIB)

# Real kube-apiserver, controller-manager, scheduler, etcd, helm, Kueue, kubectl, hadolint, the SGLang and vLLM CPU
# venvs and
# the trainers' venv (cached by version). The Go builds run beside the venvs (tests/build_tools.sh).
test-tools:
	MAKE="$(MAKE)" bash tests/build_tools.sh

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy extractor/hsx_extractor operator/hsx_operator

# The fuzz properties of every surface that takes outside input (tests/fuzz) with a long budget; make test
# runs them with a short one. A failure prints the example: add it to the property's @example corpus.
fuzz: venv
	HSX_FUZZ=long $(BIN)/python -m pytest -q -p no:cacheprovider tests/fuzz

# Prints where the time went at the end (set-up, lint, tests), pass or fail: CI has 90 minutes in all.
test:
	@bash tests/timed_test.sh "$(MAKE)" "$(BIN)"

demo: venv
	$(BIN)/hsx demo

dev-cluster: venv test-tools
	$(BIN)/python -m tests.ground.devcluster

# A bucket on the running dev cluster's S3 server: make dev-bucket NAME=my-bucket
dev-bucket: venv
	$(BIN)/python -m tests.ground.devcluster bucket "$(NAME)"

# hsx's four images for your registry, with Docker Buildx (the Dockerfile's targets); PUSH=1 pushes them:
# make images REGISTRY=registry.example.com/hsx PUSH=1
REGISTRY ?= ghcr.io/hsx-dev
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_TARGETS := operator extractor sglang vllm
images:
	@for target in $(IMAGE_TARGETS); do \
	  echo "docker buildx build --target $$target -t $(REGISTRY)/hsx-$$target:$(VERSION) $(if $(PUSH),--push,--load) ."; \
	  docker buildx build --target $$target -t $(REGISTRY)/hsx-$$target:$(VERSION) $(if $(PUSH),--push,--load) . || exit 1; \
	done

bench: venv test-tools
	$(BIN)/python -m bench

crds: venv
	$(BIN)/python -m hsx_operator.crdgen --write crds/
	cp crds/*.yaml charts/hsx/crds/

clean:
	rm -rf $(VENV) $(NATIVE_LIB) .pytest_cache .mypy_cache .ruff_cache demo-output
