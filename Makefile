# Build the drop-in sglang wheel and test it installed, as users get it (DESIGN.md section 1).
PY    := .venv/bin/python
WHEEL := dist/sglang-0.5.23+dwu1-*.whl
SITE   = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
PLANNER = $(SITE)/sglang/srt/weight_sync/planner.py

.PHONY: venv wheel install test bench demo clean

venv:
	bash scripts/setup_env.sh

# python3 is the interpreter setup_env.sh builds .venv from, so the upstream wheel's cpXY tag matches it.
wheel:
	python3 scripts/build_wheel.py

# Symlinks left in site-packages (dev hacks) are not in upstream's RECORD, so pip would keep them: drop them first.
install: venv wheel
	find $(SITE)/sglang -type l -delete 2>/dev/null || true
	$(PY) -m pip install -q --no-deps --force-reinstall --no-index $(WHEEL)
	@test -f $(PLANNER) -a ! -L $(PLANNER) || { echo "install: $(PLANNER) is not a regular file" >&2; exit 1; }

# Run from the repo root: python/sglang has no __init__.py, so `import sglang` resolves to the installed wheel.
test: install
	$(PY) -m pytest test -q -x --timeout=600 -p no:cacheprovider

bench: install
	$(PY) -m benchmark.weight_sync.simulate
	$(PY) -m benchmark.weight_sync.cpu_run

# A real engine on CPU updated by a simulated FSDP trainer, against upstream's path in the same run.
demo: install
	$(PY) -m benchmark.weight_sync.demo

clean:
	rm -rf build dist
