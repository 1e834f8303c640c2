# `make demo` and `make test` do all set-up on a fresh Debian machine: system packages (when
# root), a virtualenv in .venv, and an editable install. Both are idempotent and fast the second time.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MFS := $(VENV)/bin/monarch-fs
STAMP := $(VENV)/.installed
PYFUSE3_STAMP := $(VENV)/.pyfuse3-patched
# An unpatched build of the same sdist, which tests put first on PYTHONPATH to check that
# monarch-fs still works (one round trip per open) with what `pip install .` alone gives.
STOCK_PYFUSE3 := $(VENV)/stock-pyfuse3
PYFUSE3_VERSION := 3.5.0
PYFUSE3_SHA256 := 88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
APT_PACKAGES := fuse3 libfuse3-dev pkg-config rsync zstd iproute2 \
                slurmctld slurmd slurm-client munge

.PHONY: test test-fast lint typecheck docs demo bench system-deps clean

# Everything: type check, lint, a strict build of the docs, then every test (real daemons, FUSE
# mounts, namespaces as root; tests/test_docs.py runs the docs' examples).
test: $(STAMP) $(STOCK_PYFUSE3)/.built typecheck
	$(VENV)/bin/ruff check
	$(MAKE) --no-print-directory docs MKDOCS_FLAGS=--strict
	$(PY) -m pytest -q

# The pure part: no mount, no network namespace, nothing slow (see the markers in pyproject.toml).
test-fast: $(STAMP)
	$(VENV)/bin/ruff check
	$(PY) -m pytest -q -m "not mount and not netns and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check

# The documentation site (mkdocs.yml, docs/) into build/site; make test adds --strict, where a
# broken link, anchor, nav entry or API reference fails the build. docs/hooks.py fills in the
# references generated from the code.
MKDOCS_FLAGS ?=
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build $(MKDOCS_FLAGS)
	@echo "docs: build/site/index.html"

# mypy over everything installed as monarch_fs. It cannot follow the install's folder mapping
# (fs/ is monarch_fs.fs), so it reads a tree of symlinks that spells the installed names.
TYPECHECK := $(VENV)/typecheck
typecheck: $(STAMP)
	@rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/monarch_fs && \
	for f in monarch_fs/*.py; do ln -s "$(CURDIR)/$$f" $(TYPECHECK)/monarch_fs/; done && \
	for d in fs daemon mesh; do ln -s "$(CURDIR)/$$d" $(TYPECHECK)/monarch_fs/$$d; done
	cd $(TYPECHECK) && MYPYPATH=. $(CURDIR)/$(VENV)/bin/mypy -p monarch_fs \
	  --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/$(VENV)/mypy-cache

# The main job end to end on a local 3-node cluster: push, check every node, edit, push again,
# then a supervised SPMD job (2 nodes x 2 procs) running from a pushed workspace, the
# nodes' events asked which rank died, and a hung job caught with every rank's stacks.
demo: $(STAMP)
	@set -euo pipefail; export PATH="$$PWD/$(VENV)/bin:$$PATH"; \
	export MONARCH_FS_HOME="$$(mktemp -d /tmp/monarch-fs-demo.XXXXXX)"; C="$$MONARCH_FS_HOME/cluster"; \
	trap 'monarch-fs cluster down >/dev/null; rm -rf "$$MONARCH_FS_HOME"' EXIT; \
	step() { printf '\n\033[1m$$ %s\033[0m\n' "$$*"; "$$@"; }; \
	step monarch-fs cluster up --nodes 3; \
	APP="$$MONARCH_FS_HOME/app"; mkdir -p "$$APP"; cp -r fs daemon mesh README.md "$$APP/"; \
	printf 'print("training step 1")\n' > "$$APP/train.py"; \
	step monarch-fs push "$$APP" --compile; \
	printf '\n\033[1mevery node serves the same files (sha256 of the whole tree):\033[0m\n'; \
	for i in 0 1 2; do \
	  printf '  node-%s  %s\n' $$i "$$(cd $$C/node-$$i/mnt/app && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"; \
	done; \
	printf '\n\033[1medit train.py and push again:\033[0m\n'; \
	printf 'print("training step 2: edited")\n' > "$$APP/train.py"; \
	step monarch-fs push "$$APP" --compile; \
	for i in 0 1 2; do printf '  node-%s: %s\n' $$i "$$(python3 $$C/node-$$i/mnt/app/train.py)"; done; \
	printf '\n\033[1mthe previous version stays readable under .versions:\033[0m\n'; \
	ls "$$C/node-0/mnt/.versions/app"; \
	step monarch-fs status; \
	printf '\n\033[1ma supervised 2x2 job from a pushed workspace: torch gloo all_reduce on 2 nodes x 2 procs;\n'; \
	printf 'rank 3 crashes on the first attempt, the job is stopped and restarted once:\033[0m\n'; \
	JOB="$$MONARCH_FS_HOME/job"; mkdir -p "$$JOB"; cp tests/allreduce_job.py "$$JOB/train.py"; \
	step monarch-fs push "$$JOB" --compile; \
	step monarch-fs run --hosts "$$(head -n 2 $$C/hosts | paste -sd, -)" --per-host 2 --max-restarts 1 \
	  --workspace job -- "$$PWD/$(VENV)/bin/python" train.py --crash-once 3; \
	printf '\n\033[1mevery node keeps its events; which rank died, and what it printed:\033[0m\n'; \
	sleep 0.5; \
	step monarch-fs query "SELECT host, rank, code, restart, text FROM events WHERE kind = 'proc.exited' AND code != 0 ORDER BY ts"; \
	printf '\n\033[1ma hang: rank 3 blocks loading its batch while the others wait for it in all_reduce;\n'; \
	printf 'after 8 s without a line from any rank, run shows every rank'"'"'s stacks and stops the job:\033[0m\n'; \
	step monarch-fs run --hosts "$$(head -n 2 $$C/hosts | paste -sd, -)" --per-host 2 --hang-timeout 8 \
	  --workspace job -- "$$PWD/$(VENV)/bin/python" train.py --hang 3 || true; \
	step monarch-fs query "SELECT host, rank, top FROM stacks WHERE hang IS NOT NULL ORDER BY rank"; \
	step monarch-fs cluster down

# The suite (bench/run_all.py: push, reads, import torch, find over 100k files and, as root, a
# cold push over 1 Gbit/s links vs rsync -a to each host; under 10 minutes on 2 cores).
# BENCH_ARGS=--quick for a 1-2 minute smoke run. FANOUT=1 adds the fan-out
# benchmark (network namespaces, root; several more minutes, so not in the default budget).
bench: $(STAMP)
	$(PY) -m bench.run_all $(BENCH_ARGS)
	@if [ -n "$(FANOUT)" ]; then \
	  if [ "$$(id -u)" = 0 ]; then $(PY) -m bench.fanout_bench; \
	  else echo "fanout_bench: skipped (network namespaces need root)"; fi; \
	fi

# Debian packages, by name: pyfuse3 is built against libfuse3-dev (found with pkg-config), a
# mount by a user other than root needs fusermount3, benchmarks compare against rsync and zstd,
# the network tests make namespaces with ip, and the SLURM tests (tests/slurm.py) start their own
# slurmctld, slurmd and munged (in /usr/sbin, which a user's PATH may lack). Those tests never
# use the packages' services or their configuration in /etc. Where no init system runs (a
# container, like the machine this was written on) installing starts nothing; on a machine with
# systemd, apt enables and starts munge (and tries slurmctld and slurmd, which fail without an
# /etc/slurm/slurm.conf): `systemctl disable --now munge slurmctld slurmd` undoes that.
system-deps:
	@missing=""; PATH="$$PATH:/usr/sbin:/sbin"; \
	command -v pkg-config >/dev/null || missing="$$missing pkg-config"; \
	pkg-config --exists fuse3 2>/dev/null || missing="$$missing libfuse3-dev"; \
	command -v fusermount3 >/dev/null || missing="$$missing fuse3"; \
	command -v rsync >/dev/null || missing="$$missing rsync"; \
	command -v zstd >/dev/null || missing="$$missing zstd"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	command -v slurmctld >/dev/null || missing="$$missing slurmctld"; \
	command -v slurmd >/dev/null || missing="$$missing slurmd"; \
	command -v srun >/dev/null || missing="$$missing slurm-client"; \
	command -v munged >/dev/null || missing="$$missing munge"; \
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
	$(PY) -m pip install -q -e '.[test,docs]'
	@# An editable install compiles nothing, and a shell with PYTHONDONTWRITEBYTECODE=1 never
	@# writes the .pyc files: every command would compile the sources at start (~0.1 s).
	$(PY) -m compileall -q monarch_fs fs daemon mesh
	@touch $(STAMP)

# pyfuse3 from its sdist, fetched by name with pip and checked against a pinned sha256, with
# fs/pyfuse3.patch, built against the system's libfuse 3 (Debian 12: 3.14): no open/opendir
# round trips, passthrough, counted ioctls (see fs/open_mode.py and fs/passthrough.py).
$(PYFUSE3_STAMP): fs/pyfuse3.patch
	@$(MAKE) --no-print-directory system-deps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@set -euo pipefail; d="$$(mktemp -d)"; trap 'rm -rf "$$d"' EXIT; \
	echo "building pyfuse3 $(PYFUSE3_VERSION) with fs/pyfuse3.patch against libfuse $$(pkg-config --modversion fuse3)"; \
	$(PY) -m pip download -q --no-deps --no-binary :all: pyfuse3==$(PYFUSE3_VERSION) -d "$$d"; \
	echo "$(PYFUSE3_SHA256)  $$d/pyfuse3-$(PYFUSE3_VERSION).tar.gz" | sha256sum -c --quiet; \
	tar -xzf "$$d/pyfuse3-$(PYFUSE3_VERSION).tar.gz" -C "$$d"; \
	src="$$d/pyfuse3-$(PYFUSE3_VERSION)"; \
	(cd "$$src" && git apply "$(CURDIR)/fs/pyfuse3.patch" && rm -f src/pyfuse3/__init__.c); \
	SETUPTOOLS_SCM_PRETEND_VERSION=$(PYFUSE3_VERSION) $(PY) -m pip install -q --force-reinstall "$$src"
	$(PY) -c 'import pyfuse3; assert pyfuse3.FH_ZERO_IS_INODE and hasattr(pyfuse3, "passthrough_negotiated") and hasattr(pyfuse3, "ioctls")'
	@touch $(PYFUSE3_STAMP)

$(STOCK_PYFUSE3)/.built: $(PYFUSE3_STAMP)
	@set -euo pipefail; d="$$(mktemp -d)"; trap 'rm -rf "$$d"' EXIT; \
	echo "building an unpatched pyfuse3 $(PYFUSE3_VERSION) into $(STOCK_PYFUSE3) (for the tests)"; \
	$(PY) -m pip download -q --no-deps --no-binary :all: pyfuse3==$(PYFUSE3_VERSION) -d "$$d"; \
	echo "$(PYFUSE3_SHA256)  $$d/pyfuse3-$(PYFUSE3_VERSION).tar.gz" | sha256sum -c --quiet; \
	rm -rf $(STOCK_PYFUSE3); \
	SETUPTOOLS_SCM_PRETEND_VERSION=$(PYFUSE3_VERSION) $(PY) -m pip install -q --no-deps \
	  --target $(STOCK_PYFUSE3) "$$d/pyfuse3-$(PYFUSE3_VERSION).tar.gz"
	@touch $@

clean:
	rm -rf $(VENV) build *.egg-info
