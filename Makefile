# The README's commands. `make train` installs exp with what training needs, `make test` with its dev extra
# (pytest, ruff, the sweepers and the report's plots); each install runs only when it has not run yet for this
# Python environment, or pyproject.toml or constraints/ changed since.
PYTHON ?= python
# Without an NVIDIA driver, take the CPU build of torch (this machine kind has it on disk) instead of a CUDA build.
TORCH_CONSTRAINT := $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints/cpu.txt)
# The stamps of the installs, one folder per Python environment (a new virtualenv installs afresh), git-ignored.
# "elsewhere": the environment's `exp` is not this checkout's (an editable install follows the checkout installed
# last), so the install runs again whatever the stamps say.
PY_ENV := $(shell $(PYTHON) -c 'import hashlib, importlib.util as u, pathlib as p, sys; s = u.find_spec("exp"); here = bool(s and s.origin) and p.Path(s.origin).resolve().parents[1] == p.Path("src").resolve(); print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12], "here" if here else "elsewhere")' 2>/dev/null)
STAMPS := .cache/make/$(word 1,$(PY_ENV))
STALE := $(if $(filter here,$(word 2,$(PY_ENV))),,FORCE)
INSTALL_INPUTS := pyproject.toml $(wildcard constraints/*.txt)

.PHONY: train test lint FORCE

$(STAMPS)/train: $(INSTALL_INPUTS) $(STALE)
	$(PYTHON) -m pip install -q -e . $(TORCH_CONSTRAINT)
	@mkdir -p $(@D) && touch $@

# The dev extra holds all that training needs: its install stands for both.
$(STAMPS)/dev: $(INSTALL_INPUTS) $(STALE)
	$(PYTHON) -m pip install -q -e ".[dev]" $(TORCH_CONSTRAINT)
	@mkdir -p $(@D) && touch $@ $(@D)/train

train: $(STAMPS)/train
	$(PYTHON) -m exp.train $(ARGS)

test: $(STAMPS)/dev
	$(PYTHON) -m pytest $(ARGS)

lint:
	ruff check . && ruff format --check .
