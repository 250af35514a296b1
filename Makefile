# Set-up from a fresh clone: `make demo` (the main job) and `make test` (the whole suite).
# torch is installed first and never replaced: pip's resolver then finds it satisfies vispec's range.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: install browser demo test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[test]"
	@if $(BIN)/python -m pip list 2>/dev/null | grep -i '^nvidia-'; then \
		echo "error: CUDA wheels were pulled into $(VENV); install a CPU torch first"; exit 1; fi
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/vispec demo

# headless Chromium (a Debian package) for the test that opens the demo's page; installed where apt-get and root
# allow it, else that test is skipped and says why
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && echo "installing chromium (apt-get) ..." && \
	  apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } || \
	echo "chromium not installed: tests/eval/test_demo_page.py will be skipped"

test: install browser
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n auto --dist worksteal --durations=30 tests

bench: install
	$(BIN)/vispec bench decoders --json bench-decoders.json

clean:
	rm -rf $(VENV) out .pytest_cache site .mkdocs-api
