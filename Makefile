# Two commands do all set-up on a fresh Linux machine with Python 3.11+:
#   make demo   – create .venv, install, run the main job on the embedded default
#   make demo-pd – the same for the PD-disaggregation stand-in (router, prefill and decode groups)
#   make test   – create .venv, install, pass the tests (make test-long: the slow ones)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo demo-pd test test-long clean

# The last step compiles the checkout's own bytecode once (every module but the venv's, so no package list to keep):
# pip compiles site-packages but not an editable project, and with PYTHONDONTWRITEBYTECODE (common in images) every
# `durastack` command would compile it again (~0.04 s).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m compileall -q -x '/\.venv/' . > /dev/null
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/durastack offers -f examples/replica-groups-service.yml --limit 3
	$(BIN)/python examples/demo.py

# PD disaggregation: a router group in front of prefill and autoscaled decode workers (examples/pd-disaggregation).
demo-pd: install
	$(BIN)/python examples/demo_pd.py

test: install
	$(BIN)/python -m pytest -q -m "not long"

# The slow ones: a 30-simulated-day soak, restarts of each component during rollouts and scale-ups.
test-long: install
	$(BIN)/python -m pytest -q -m long

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
