# Two commands on a fresh machine (docs/install.md):
#   make quickstart   set up .venv if missing, then train and validate the tiny presets, offline
#   make test         set up .venv if missing, then run the test suite but its long tests (CI's .ci/run calls this)
#   make test-all     the same with the long tests (tests/long.txt)
# The virtual environment sees what this Python already has (--system-site-packages) and installs only what the
# requirements add; .venv/.installed remembers it until a requirements file changes.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# make quickstart STEPS=200: shorter runs; VALIDATE="--limit 100": fewer validation samples
STEPS ?=
VALIDATE ?=
# make test TESTS="tests/config -x": a part of the suite. CI's `make test` leaves out the long tests
# (tests/long.txt: its 20 minutes); `make test-all` runs every test
TESTS ?= -m "not long" -n 2 --dist loadfile tests
OFFLINE := JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline

.PHONY: venv quickstart test test-all clean-venv

$(VENV)/.installed: requirements.txt requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	@touch $@

venv: $(VENV)/.installed

# each preset trains into its checkpoint directory unless a finished step is there already (then it is validated
# again: remove the directory to train anew)
quickstart: $(VENV)/.installed
	@for run in "tiny ckpt/tiny" "gptj_tiny ckpt/gptj"; do set -- $$run; \
	  if ls "$$2"/*/commit_success.txt >/dev/null 2>&1; then \
	    echo "$$2 holds a trained $$1 run: validating it (remove $$2 to train it again)"; \
	  else \
	    $(OFFLINE) $(PY) run_finetuning.py --config $$1 --save $$2 $(if $(STEPS),--steps $(STEPS)) || exit $$?; \
	  fi; \
	  $(OFFLINE) $(PY) run_validation.py --load $$2 $(VALIDATE) || exit $$?; \
	done

test: $(VENV)/.installed
	$(OFFLINE) $(PY) -m pytest -q -ra --durations=15 $(TESTS)

test-all: $(VENV)/.installed
	$(OFFLINE) $(PY) -m pytest -q -ra --durations=15 -n 2 --dist loadfile tests

clean-venv:
	rm -rf $(VENV)
