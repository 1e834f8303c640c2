# `make demo` and `make test` do all set-up on a fresh Debian machine: system packages (when
# root), a virtualenv in .venv, and an editable install. Both are idempotent and fast the second time.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MFS := $(VENV)/bin/monarch-fs
STAMP := $(VENV)/.installed
PYFUSE3_STAMP := $(VENV)/.pyfuse3-patched
# libfuse 3.17 (Debian 12 ships 3.14; passthrough needs 3.16+), from Debian's source archive.
LIBFUSE_VERSION := 3.17.2
LIBFUSE_SHA256 := 3d932431ad94e86179e5265cddde1d67aa3bb2fb09a5bd35c641f86f2b5ed06f
LIBFUSE_URL := https://deb.debian.org/debian/pool/main/f/fuse3/fuse3_$(LIBFUSE_VERSION).orig.tar.gz
LIBFUSE := $(CURDIR)/$(VENV)/libfuse
LIBFUSE_STAMP := $(VENV)/.libfuse-$(LIBFUSE_VERSION)
PYFUSE3_VERSION := 3.5.0
PYFUSE3_SHA256 := 88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
APT_PACKAGES := fuse3 pkg-config rsync zstd iproute2 curl

.PHONY: test demo bench system-deps clean

test: $(STAMP)
	$(PY) -m pytest -q

# The main job end to end on a local 3-node cluster: push, check every node, edit, push again,
# then a supervised SPMD job (2 nodes x 2 procs) running from a pushed workspace.
demo: $(STAMP)
	@set -euo pipefail; export PATH="$$PWD/$(VENV)/bin:$$PATH"; \
	export MONARCH_FS_HOME="$$(mktemp -d /tmp/monarch-fs-demo.XXXXXX)"; C="$$MONARCH_FS_HOME/cluster"; \
	trap 'monarch-fs cluster down >/dev/null; rm -rf "$$MONARCH_FS_HOME"' EXIT; \
	step() { printf '\n\033[1m$$ %s\033[0m\n' "$$*"; "$$@"; }; \
	step monarch-fs cluster up --nodes 3; \
	APP="$$MONARCH_FS_HOME/app"; mkdir -p "$$APP"; cp -r fs daemon mesh README.md "$$APP/"; \
	printf 'print("training step 1")\n' > "$$APP/train.py"; \
	step monarch-fs push "$$APP" --exclude __pycache__; \
	printf '\n\033[1mevery node serves the same files (sha256 of the whole tree):\033[0m\n'; \
	for i in 0 1 2; do \
	  printf '  node-%s  %s\n' $$i "$$(cd $$C/node-$$i/mnt/app && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"; \
	done; \
	printf '\n\033[1medit train.py and push again:\033[0m\n'; \
	printf 'print("training step 2: edited")\n' > "$$APP/train.py"; \
	step monarch-fs push "$$APP" --exclude __pycache__; \
	for i in 0 1 2; do printf '  node-%s: %s\n' $$i "$$(python3 $$C/node-$$i/mnt/app/train.py)"; done; \
	printf '\n\033[1mthe previous version stays readable under .versions:\033[0m\n'; \
	ls "$$C/node-0/mnt/.versions/app"; \
	step monarch-fs status; \
	printf '\n\033[1ma supervised 2x2 job from a pushed workspace: torch gloo all_reduce on 2 nodes x 2 procs;\n'; \
	printf 'rank 3 crashes on the first attempt, the job is stopped and restarted once:\033[0m\n'; \
	JOB="$$MONARCH_FS_HOME/job"; mkdir -p "$$JOB"; cp tests/allreduce_job.py "$$JOB/train.py"; \
	step monarch-fs push "$$JOB"; \
	step monarch-fs run --hosts "$$(head -n 2 $$C/hosts | paste -sd, -)" --per-host 2 --max-restarts 1 \
	  --workspace job -- "$$PWD/$(VENV)/bin/python" train.py --crash-once 3; \
	step monarch-fs cluster down

# The suite (bench/run_all.py: push, reads, import torch, find over 100k files and, as root, a
# cold push over 1 Gbit/s links vs rsync -a to each host; under 10 minutes on 2 cores).
# BENCH_ARGS=--quick for a 1-2 minute smoke run. FANOUT=1 adds the fan-out
# benchmark (network namespaces, root; several more minutes, so not in the default budget).
bench: $(STAMP)
	$(PY) bench/run_all.py $(BENCH_ARGS)
	@if [ -n "$(FANOUT)" ]; then \
	  if [ "$$(id -u)" = 0 ]; then $(PY) bench/fanout_bench.py; \
	  else echo "fanout_bench: skipped (network namespaces need root)"; fi; \
	fi

# Debian packages: the libfuse and pyfuse3 builds need pkg-config and curl, a mount by a user
# other than root needs fusermount3, benchmarks compare against rsync and zstd.
system-deps:
	@missing=""; \
	command -v pkg-config >/dev/null || missing="$$missing pkg-config"; \
	command -v fusermount3 >/dev/null || missing="$$missing fuse3"; \
	command -v rsync >/dev/null || missing="$$missing rsync"; \
	command -v zstd >/dev/null || missing="$$missing zstd"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	  else \
	    echo "error: missing Debian packages:$$missing"; \
	    echo "       run as root: apt-get install -y $(APT_PACKAGES)"; exit 1; \
	  fi; \
	fi

$(STAMP): pyproject.toml $(PYFUSE3_STAMP)
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

# libfuse 3.17 built into .venv/libfuse (the library only; fusermount3 comes from Debian's fuse3).
$(LIBFUSE_STAMP):
	@$(MAKE) --no-print-directory system-deps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip meson ninja
	@set -euo pipefail; d="$$(mktemp -d)"; trap 'rm -rf "$$d"' EXIT; \
	echo "building libfuse $(LIBFUSE_VERSION) into $(LIBFUSE)"; \
	curl -fsSL --retry 3 -o "$$d/libfuse.tar.gz" "$(LIBFUSE_URL)"; \
	echo "$(LIBFUSE_SHA256)  $$d/libfuse.tar.gz" | sha256sum -c --quiet; \
	tar -xzf "$$d/libfuse.tar.gz" -C "$$d"; \
	export PATH="$(CURDIR)/$(VENV)/bin:$$PATH"; \
	meson setup "$$d/build" "$$d/fuse-$(LIBFUSE_VERSION)" --prefix="$(LIBFUSE)" --libdir=lib \
	  --buildtype=release -Dexamples=false -Dutils=false -Dtests=false >"$$d/meson.log" 2>&1 \
	  || { cat "$$d/meson.log"; exit 1; }; \
	ninja -C "$$d/build" install >"$$d/ninja.log" 2>&1 || { cat "$$d/ninja.log"; exit 1; }
	@touch $(LIBFUSE_STAMP)

# pyfuse3 from its PyPI sdist (checked against a pinned sha256) with fs/pyfuse3.patch, linked
# against that libfuse: no open/opendir round trips, passthrough, counted ioctls (see fs/fuse_ops.py).
$(PYFUSE3_STAMP): fs/pyfuse3.patch $(LIBFUSE_STAMP)
	@set -euo pipefail; d="$$(mktemp -d)"; trap 'rm -rf "$$d"' EXIT; \
	echo "building pyfuse3 $(PYFUSE3_VERSION) with fs/pyfuse3.patch"; \
	$(PY) -m pip download -q --no-deps --no-binary :all: pyfuse3==$(PYFUSE3_VERSION) -d "$$d"; \
	echo "$(PYFUSE3_SHA256)  $$d/pyfuse3-$(PYFUSE3_VERSION).tar.gz" | sha256sum -c --quiet; \
	tar -xzf "$$d/pyfuse3-$(PYFUSE3_VERSION).tar.gz" -C "$$d"; \
	src="$$d/pyfuse3-$(PYFUSE3_VERSION)"; \
	(cd "$$src" && git apply "$(CURDIR)/fs/pyfuse3.patch" && rm -f src/pyfuse3/__init__.c); \
	PKG_CONFIG_PATH="$(LIBFUSE)/lib/pkgconfig" LDFLAGS="-Wl,-rpath,$(LIBFUSE)/lib" \
	SETUPTOOLS_SCM_PRETEND_VERSION=$(PYFUSE3_VERSION) $(PY) -m pip install -q --force-reinstall "$$src"
	$(PY) -c 'import pyfuse3; assert pyfuse3.FH_ZERO_IS_INODE and hasattr(pyfuse3, "WANT_PASSTHROUGH") and hasattr(pyfuse3, "ioctls")'
	@touch $(PYFUSE3_STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
