# Two commands are all a newcomer needs:  make demo   and   make test
# Extra pytest arguments pass through:   make test PYTEST_ARGS='-k slurm'
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTEST_ARGS ?=
# pytest-xdist workers, each process on one intra-op thread. Four on a 2-core machine: the suite waits more than
# it computes (Slurm scheduling, time limits, subprocess start-up); with 3 workers the whole suite kept the machine at
# 140% CPU (20:40 on 2026-12-05), and 2 kept it about half idle. PYTEST_WORKERS=0 runs the suite in this one process.
PYTEST_WORKERS ?= 4

.PHONY: demo test install install-dev lock upgrade slurm-up slurm-down chromium lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# A current pip before anything else: the one a Python 3.11 venv bundles (23.2) spent 142 CPU-s resolving
# and installing '.[dev]', 26.3 spent 97 CPU-s on the same versions (measured on the 2-core machine).
$(VENV)/.pip: | $(PY)
	$(PIP) install pip==26.3
	touch $@

# The locks (requirements/*.txt, made by scripts/lock) hold every package at the version the suite passed with, with
# its hashes: pip installs exactly those (--no-deps: nothing is resolved at install time), then postlab itself, and
# `pip check` proves the set complete. torch is the lock's CPU build 2.13.0, which lies on this kind of machine's disk.
$(VENV)/.installed: pyproject.toml requirements/runtime.txt | $(VENV)/.pip
	$(PIP) install --require-hashes --no-deps -r requirements/runtime.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	$(PIP) check
	touch $@

$(VENV)/.installed-dev: pyproject.toml requirements/dev.txt | $(VENV)/.pip
	$(PIP) install --require-hashes --no-deps -r requirements/dev.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	$(PIP) check
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The toy world (built once, then cached in lab/), a whole session to a checked nomination, and its report.
# One intra-op thread per job: the world's models are tiny, and on a shared 2-core machine two OpenMP threads
# per process spun the same 64 answers to 44.7 s of CPU (406 s wall) against 3.0 s (50 s) with one.
demo: export OMP_NUM_THREADS = 1
demo: $(VENV)/.installed
	$(PY) run_agent.py world build --lab lab --size demo
	$(PY) run_agent.py --budget 60gpuh --lab lab; rc=$$?; $(PY) run_agent.py report --lab lab -o lab/report.html; exit $$rc

# Installs the venv while Chromium and the loopback Slurm cluster come up in the background (neither
# needs the venv; one chain, since both may apt-get install and two apt-gets refuse each other's lock),
# runs the whole suite on $(PYTEST_WORKERS) workers (tests/conftest.py keeps each shared session on
# one), stops the cluster, and exits with pytest's status (5, "no tests ran", is a failure too).
# A cluster that cannot start skips the Slurm tests, each saying why. (`make`, not $(MAKE): a line naming
# $(MAKE) runs even under `make -n`, and this one runs the suite.)
test:
	@services=$$(mktemp); \
	  { make --no-print-directory chromium && { scripts/slurm-up || echo "make test: the loopback Slurm cluster did not start; Slurm tests will be skipped with the reason"; }; } >$$services 2>&1 & bg=$$!; \
	  make --no-print-directory install-dev; installed=$$?; wait $$bg; up=$$?; cat $$services; rm -f $$services; \
	  [ $$installed -eq 0 ] && [ $$up -eq 0 ] || exit 1; \
	  $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; scripts/slurm-down; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests"; fi; exit $$rc

# Headless Chromium (Debian's package) opens the HTML report in the report tests. Without recommends: the
# desktop's (a printer dialog, Mesa's GL drivers, a notification daemon, upower) are not needed headless;
# its one font recommend is kept, so the report renders with the fonts a default install has.
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null; }
	@command -v chromium >/dev/null || { echo "make test: could not install chromium (apt-get as root)"; exit 1; }

slurm-up:
	scripts/slurm-up

slurm-down:
	scripts/slurm-down

# Re-resolve the locks (keeping what the ranges still allow), or move them to the newest versions the ranges allow,
# reinstall .venv from the new lock and run the whole suite on it. Commit requirements/ once the suite passes.
lock: $(VENV)/.installed-dev
	scripts/lock

upgrade: $(VENV)/.installed-dev
	scripts/lock --upgrade
	rm -rf $(VENV)
	make --no-print-directory test

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
