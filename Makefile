# `make demo` and `make test` do all set-up on a fresh Debian machine: system packages (when
# root), a virtualenv in .venv, and an editable install. Both are idempotent and fast the second time.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MFS := $(VENV)/bin/monarch-fs
STAMP := $(VENV)/.installed
APT_PACKAGES := fuse3 libfuse3-dev pkg-config rsync zstd iproute2

.PHONY: test demo bench system-deps clean

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	@$(PY) -m monarch_fs.daemon.demo

bench: $(STAMP)
	$(PY) bench/push_bench.py

# Debian packages: pyfuse3 builds against libfuse3, the mount needs fusermount3, benchmarks
# compare against rsync and zstd.
system-deps:
	@missing=""; \
	pkg-config --exists fuse3 2>/dev/null || missing="$$missing libfuse3-dev pkg-config"; \
	command -v fusermount3 >/dev/null || missing="$$missing fuse3"; \
	command -v rsync >/dev/null || missing="$$missing rsync"; \
	command -v zstd >/dev/null || missing="$$missing zstd"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	  else \
	    echo "error: missing Debian packages:$$missing"; \
	    echo "       run as root: apt-get install -y $(APT_PACKAGES)"; exit 1; \
	  fi; \
	fi

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
