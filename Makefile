# Build the drop-in sglang wheels and test them installed, as users get them (docs/design.md).
# BASE picks the SGLang release for venv/install/test/smoke: 0.5.23 (primary, .venv), 0.5.15.post1, 0.5.12
# or 0.5.10.post1 (.venv-<BASE>); `make wheel` always builds all four.
BASE  ?= 0.5.23
VENV  := $(if $(filter 0.5.23,$(BASE)),.venv,.venv-$(BASE))
PY    := $(VENV)/bin/python
WHEEL := dist/sglang-$(BASE)+dwu1-*.whl
SITE   = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
PLANNER = $(SITE)/sglang/srt/weight_sync/planner.py

.PHONY: venv wheel install test test-gpu gpu-carry smoke smoke-run bench demo lint format pr clean

venv:
	BASE=$(BASE) VENV=$(VENV) bash scripts/setup_env.sh

# python3 is the interpreter setup_env.sh builds .venv from, so the upstream wheel's cpXY tag matches it.
wheel:
	python3 scripts/build_wheel.py
	touch $(BUILT)

# `install` builds the four wheels only when what goes into them changed since the last build (a
# file, or a folder's entries: a file added or removed), so that installing each base in turn
# (.ci/run) builds them once.
BUILT := dist/.built
$(BUILT): $(shell find python patches -name __pycache__ -prune -o -print 2>/dev/null) scripts/build_wheel.py
	python3 scripts/build_wheel.py
	touch $@

# Symlinks left in site-packages (dev hacks) are not in upstream's RECORD, so pip would keep them: drop them first.
install: venv $(BUILT)
	find $(SITE)/sglang -type l -delete 2>/dev/null || true
	$(PY) -m pip install -q --no-deps --force-reinstall --no-index $(WHEEL)
	@test -f $(PLANNER) -a ! -L $(PLANNER) || { echo "install: $(PLANNER) is not a regular file" >&2; exit 1; }

# Run from the repo root: python/sglang has no __init__.py, so `import sglang` resolves to the installed wheel.
# TIER=unit|distributed|e2e|reliability runs one tier (pytest -m, markers from test/conftest.py); the
# slowest tests are printed at the end. JOBS pytest-xdist workers (whole files each: a module's
# engine fixtures start once) share the machine: most tests wait on engine processes or on bounds
# for part of their time (docs/results.md); JOBS=0 runs in one process.
TIER ?=
JOBS ?= 2
# The older bases' smoke test is deselected: test_qwen2_every_entry_point_and_refusals[2] runs its
# steps and more on the same kind of engine (test_distributed_update.py). So is slime's companion
# test, 0.5.15.post1's smoke: its glue is the same on every base, and megatron_flow and
# RemoteSync.update_megatron run here in test_megatron_update.py and the remote-engine tests.
test: install
	$(PY) -m pytest test -q --timeout=600 --durations=40 -p no:cacheprovider $(if $(TIER),-m "$(TIER)") \
		-n $(JOBS) --dist loadfile \
		--deselect test/e2e/test_distributed_update.py::test_smoke_fsdp_trainer_updates_engine \
		--deselect test/e2e/test_slime_companion.py

# The GPU tier (docs/gpu.md). Without a CUDA device every case is skipped with its reason; on a
# GPU machine (no network needed, .gpu/ from `make gpu-carry`) it runs test/gpu, then the
# 8B-shaped update benchmark.
test-gpu:
	@if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then \
		bash scripts/gpu_run.sh && bash scripts/gpu_run.sh --bench; \
	else \
		$(MAKE) -s install && $(PY) -m pytest test/gpu -q -rs -p no:cacheprovider; \
	fi

gpu-carry:
	bash scripts/gpu_carry.sh

# The end-to-end smoke on one base (CI runs it on every base but the primary, whose full suite covers it):
# FSDP trainer ranks -> a TP-2 engine through every entry point, verl 0.9.1's own update code
# feeding one TP-1 server per trainer rank (trainer-side resharding), AReaL 1.0.4's own SGLang client
# (its NCCL-style broadcast on gloo, and its disk update); and what each base's torch release
# changes: the placements' wire form (2.9 makes _StridedShard a Shard; 2.13 adds _split_factor_int) and
# what FSDP2 over TP means by _StridedShard (2.9 shards right to left), checked against real FSDP2 shards.
# Targets derived from that release's own loaders: equal to its real load (17 architectures, both
# platforms; repeated layers loaded once, as its engine derives them), cached and keyed as its engine
# does, the load recorder under its torch, and a DeepSeek-V3-shaped model (MLA, MoE, shared
# expert) updated through a real TP-2 engine. The weight-sync group's request path as that base's
# patch hooks it (request types, Engine methods, routes, dispatch, communicators).
SMOKE := test/e2e/test_distributed_update.py::test_smoke_fsdp_trainer_updates_engine \
         test/e2e/test_verl_release.py::test_verl_server_adapter_two_servers_of_tp1 \
         test/e2e/test_areal_release.py::test_areal_updates_a_tp1_server \
         test/unit/test_source_layout.py::test_mesh_spec_round_trips_through_sglang_safe_unpickler \
         test/distributed/test_reshard.py::test_fsdp2_over_tp_strided_shards_without_a_gather \
         test/unit/test_derived_targets.py test/unit/test_repeated_layers.py test/unit/test_target_cache.py \
         test/unit/test_load_recorder.py \
         test/e2e/test_any_model_update.py::test_deepseek_v3_shaped_update_parameters \
         test/unit/test_remote_request_path.py
# And the weight-sync group with remote engines, driven by the released code of the framework
# that pins the base: verl 0.9.1's checkpoint-engine registry on 0.5.12, AReaL 1.0.4's companion
# patch beside its broadcast on 0.5.10.post1; on 0.5.15.post1 slime's three update paths and the
# routes of its own SGLang build, as its released code calls them (its launcher included), and its
# colocated update with the companion patch's glue (integrations/slime) from Megatron-core shards.
SMOKE_REMOTE_0.5.15.post1 := test/e2e/test_slime_paths.py test/e2e/test_slime_companion.py
SMOKE_REMOTE_0.5.12       := test/e2e/test_verl_checkpoint_engine.py
SMOKE_REMOTE_0.5.10.post1 := test/e2e/test_areal_remote.py
# `smoke-run` is the tests alone, on what `make install BASE=...` left: .ci/run installs each
# base's wheel in turn, then runs the bases' smokes side by side.
smoke: install
	$(MAKE) --no-print-directory smoke-run BASE=$(BASE)

smoke-run:
	$(PY) -m pytest $(SMOKE) $(SMOKE_REMOTE_$(BASE)) -q -x --timeout=600 -p no:cacheprovider

bench: install
	$(PY) -m benchmark.weight_sync.simulate
	$(PY) -m benchmark.weight_sync.disaggregated
	$(PY) -m benchmark.weight_sync.cpu_run
	$(PY) -m benchmark.weight_sync.remote_run

# A real engine on CPU updated by a simulated FSDP trainer, against upstream's path in the same run.
demo: install
	$(PY) -m benchmark.weight_sync.demo

# Lint as SGLang's pre-commit does (isort, ruff, ruff-format, codespell; versions pinned in
# scripts/requirements-lint.txt, settings in .isort.cfg, ruff.toml, .codespellrc), in a venv of
# its own. `lint` only checks (all four, then fails if any did); `format` applies the fixes in
# pre-commit's order. patches/ holds diffs of upstream files and is left out.
LINT_VENV  := .venv-lint
LINT_PATHS := python test benchmark scripts integrations

$(LINT_VENV)/.ready: scripts/requirements-lint.txt
	python3 -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q -r scripts/requirements-lint.txt
	touch $@

lint: $(LINT_VENV)/.ready
	@rc=0; \
	$(LINT_VENV)/bin/isort --check-only --diff $(LINT_PATHS) || rc=1; \
	$(LINT_VENV)/bin/ruff format --check $(LINT_PATHS) || rc=1; \
	$(LINT_VENV)/bin/ruff check $(LINT_PATHS) || rc=1; \
	$(LINT_VENV)/bin/codespell $(LINT_PATHS) || rc=1; \
	if [ $$rc -ne 0 ]; then echo "lint: not clean (make format fixes what formatting can)" >&2; fi; \
	exit $$rc

format: $(LINT_VENV)/.ready
	$(LINT_VENV)/bin/isort $(LINT_PATHS)
	$(LINT_VENV)/bin/ruff check --fix $(LINT_PATHS) || true
	$(LINT_VENV)/bin/ruff format $(LINT_PATHS)

# The change as a series of pull requests against SGLang 0.5.23's own source tree
# (scripts/make_pr.py, scripts/pr_series.toml; SGLANG_SRC=<checkout> uses a real git checkout):
# dist/pr/<nn>-<key>/. With the repo's venv installed, each pull request's modules are imported
# from its own tree.
pr: $(LINT_VENV)/.ready
	python3 scripts/make_pr.py --lint-venv $(LINT_VENV) $(if $(wildcard $(VENV)/bin/python),--python $(VENV)/bin/python)

clean:
	rm -rf build dist
