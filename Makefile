# The README's commands. `make train` and `make test` install what they need first (a no-op once installed).
PYTHON ?= python
# Without an NVIDIA driver, take the CPU build of torch (this machine kind has it on disk) instead of a CUDA build.
TORCH_CONSTRAINT := $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints/cpu.txt)

.PHONY: install train test lint

install:
	$(PYTHON) -m pip install -q -e ".[dev]" $(TORCH_CONSTRAINT)

train: install
	$(PYTHON) -m exp.train $(ARGS)

test: install
	$(PYTHON) -m pytest $(ARGS)

lint:
	ruff check . && ruff format --check .
