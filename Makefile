# The two commands a learner needs: `make lab` and `make test`.
# TORCH_SPEC picks the torch build pip installs first. The default takes PyPI's normal wheel
# (CUDA-enabled on Linux); CI, which has no GPU, passes a CPU build instead (see .ci/run).
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch>=2.6
JOBS       ?= 2
# Extras `make test` installs; CI adds "reference" (well-kept libraries that some tests compare against,
# e.g. bitsandbytes' NF4; those tests skip with a reason where the library is absent).
TEST_EXTRAS ?= lab,test
PORT       ?= 8888
BIN        := $(VENV)/bin
# Jupyter refuses to run as root unless told to (containers and cloud VMs often log in as root).
LAB_FLAGS  ?= $(if $(filter 0,$(shell id -u)),--allow-root,)

# The project's JupyterLab defaults (no "get notified about Jupyter news?" popup over the first chapter),
# installed as this venv's settings overrides: the user's own settings and other environments are untouched.
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.d/labkit.json
# The notebooks' second pass: PyTorch's non-vectorised kernels and two threads reduce in another order
# than the machine that stored the outputs, so an output that depends on the machine fails here.
PORTABLE_ENV := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 OMP_NUM_THREADS=2
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
# make test-load: the chapters whose claims rest on a time on the CPU (chapter 03: cached decoding at least 2x
# faster; its GQA speed-up is asserted on CUDA only; chapter 12: continuous batching at least 2x static's tokens/s),
# and how long its busy processes may spin at most (they end with the run).
LOAD_NOTEBOOKS ?= notebooks/00_foundations.ipynb notebooks/03_attention_kv_cache.ipynb notebooks/12_serving.ipynb \
                  notebooks/09_hardware_performance.ipynb notebooks/11_tokenization_data.ipynb
LOAD_SECONDS   ?= 900
# The other chapters (test-student's and test-portable's).
OTHER_NOTEBOOKS ?= $(filter-out $(LOAD_NOTEBOOKS),$(sort $(wildcard notebooks/[0-9]*.ipynb)))
# After a test command (pass or fail, keeping its exit status): the claims with the least headroom in its claims log.
report_margins = status=$$?; $(BIN)/python tests/claim_spread.py --margins $(1); exit $$status

# The first chapter, which `make lab` opens (chapters are notebooks/NN_topic.ipynb).
FIRST_CHAPTER := $(notdir $(firstword $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))))
# The real-browser test drives Debian's chromium (apt-get install chromium), never a downloaded browser.
CHROMIUM      ?= /usr/bin/chromium
BROWSER_JOBS  ?= 2
# `make grade SUBMISSIONS=submissions/ [CHAPTER=00] [GRADES=grades.csv] [GRADE_TIMEOUT=600] [GRADE_JOBS=2]`
# (notebooks graded at once; GRADE_JOBS=1 where a row says another submission may have touched the teacher's files)
SUBMISSIONS   ?= submissions
GRADES        ?= grades.csv
GRADE_TIMEOUT ?= 600
GRADE_JOBS    ?= 2

.PHONY: lab test test-student test-grade test-portable test-browser test-gpu unit notebooks spread student grade clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-lab: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[lab]"
	touch $@

$(LAB_OVERRIDES): jupyter/lab-overrides.json | $(BIN)/python
	mkdir -p $(dir $@)
	cp $< $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[$(TEST_EXTRAS)]"
	touch $@

$(VENV)/.installed-browser: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[lab,test,browser]"
	touch $@

## Open JupyterLab on the first chapter (only reachable from this machine; the others are in its file browser).
lab: $(VENV)/.installed-lab $(LAB_OVERRIDES)
	$(BIN)/jupyter lab --ip=127.0.0.1 --port=$(PORT) --notebook-dir=notebooks \
		--LabApp.default_url=/lab/tree/$(FIRST_CHAPTER) $(LAB_FLAGS)

## Unit tests + every notebook under nbval, on the CPU so results match the stored outputs.
## One thread per pytest worker: JOBS workers share the cores instead of oversubscribing them.
test: $(VENV)/.installed-test $(LAB_OVERRIDES)
	LABKIT_DEVICE=cpu OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(JOBS) --dist loadfile $(NBVAL) tests notebooks

## Every chapter's student version under nbval, with no exercise answered, on test-portable's code path and thread
## count: each grader cell must fail with "not answered yet", and every other cell must print what the chapter's
## stored run printed (so nothing after an exercise depends on the learner's answer). test-load runs the timing
## chapters' student versions so, beside two busy processes; this target runs the others, JOBS at a time. Together
## they are CI's second pass over the chapters' outputs. labkit.student --unanswered-run writes what nbval compares.
unanswered_runs = rm -rf $(2) && $(BIN)/python -m labkit.student --unanswered-run --out $(2) $(1) > /dev/null
test-student: $(VENV)/.installed-test
	@mkdir -p build && rm -f build/claims-student.jsonl
	$(call unanswered_runs,$(OTHER_NOTEBOOKS),build/student-runs)
	LABKIT_DEVICE=cpu LABKIT_CLAIMS_LOG=$(CURDIR)/build/claims-student.jsonl $(PORTABLE_ENV) \
		$(BIN)/python -m pytest -p no:cacheprovider -n $(JOBS) --dist loadfile $(NBVAL) build/student-runs; \
		$(call report_margins,build/claims-student.jsonl)

## Classroom grading: a class of honest and forged hand-ins, each must grade as expected; every chapter with the teacher's answers must pass.
## The attack suite grades its class one notebook at a time (a forged file write must not be blamed on another
## submission) while the teacher's answers are graded beside it: two test files, one per pytest worker.
test-grade: $(VENV)/.installed-test
	LABKIT_DEVICE=cpu LABKIT_GRADING_TEST=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -p no:cacheprovider -n 2 --dist loadfile tests/grading

## The notebooks once more under another CPU code path and thread count (CI runs it after `make test`), all but
## test-load's chapters: test-load runs those on the same code path and thread count, beside two busy processes.
## JOBS chapters at a time (none of these asserts a time: their two threads reduce in the same order either way).
## Then, pass or fail, the claims that had the least room on this machine (from build/claims-portable.jsonl).
test-portable: $(VENV)/.installed-test
	@mkdir -p build && rm -f build/claims-portable.jsonl
	LABKIT_DEVICE=cpu LABKIT_CLAIMS_LOG=$(CURDIR)/build/claims-portable.jsonl $(PORTABLE_ENV) \
		$(BIN)/python -m pytest -p no:cacheprovider -n $(JOBS) --dist loadfile $(NBVAL) $(OTHER_NOTEBOOKS); \
		$(call report_margins,build/claims-portable.jsonl)

## The chapters with timing claims, as their student versions (see test-student; every cell that asserts a claim
## is kept there as it is), under nbval on the portable code path while two busy processes share the cores
## (tests/busy.py starts them, ends them with the run, whatever way it ends); then the claims with the least room.
test-load: $(VENV)/.installed-test
	@mkdir -p build && rm -f build/claims-load.jsonl
	$(call unanswered_runs,$(LOAD_NOTEBOOKS),build/student-runs-load)
	LABKIT_DEVICE=cpu LABKIT_CLAIMS_LOG=$(CURDIR)/build/claims-load.jsonl $(PORTABLE_ENV) \
		$(BIN)/python tests/busy.py --procs 2 --seconds $(LOAD_SECONDS) -- \
		$(BIN)/python -m pytest -p no:cacheprovider $(NBVAL) build/student-runs-load; $(call report_margins,build/claims-load.jsonl)

## Every chapter in JupyterLab in headless Chromium: Run All, no errors, widgets render and react to a control.
## Screenshots go to build/screenshots/, the claims with the least room after it. One chapter: make test-browser PYTEST_ARGS="-k 00_foundations".
test-browser: $(VENV)/.installed-browser
	@test -x $(CHROMIUM) || { echo "no Chromium at $(CHROMIUM): apt-get install -y chromium (or CHROMIUM=/path/to/chromium)"; exit 1; }
	@mkdir -p build && rm -f build/claims-browser.jsonl
	LABKIT_BROWSER_TEST=1 LABKIT_CHROMIUM=$(CHROMIUM) LABKIT_DEVICE=cpu OMP_NUM_THREADS=1 \
		LABKIT_CLAIMS_LOG=$(CURDIR)/build/claims-browser.jsonl \
		$(BIN)/python -m pytest -p no:cacheprovider -n $(BROWSER_JOBS) tests/browser $(PYTEST_ARGS); \
		$(call report_margins,build/claims-browser.jsonl)

## On a CUDA machine: the kernel tests compiled, every chapter on CUDA (nbval-lax), the benchmark table (tools/gpu_run.sh,
## results in build/gpu-run/). Without CUDA it says so and does nothing (make test runs the script's dry run).
test-gpu: $(VENV)/.installed-test
	@if $(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		PYTHON=$(BIN)/python tools/gpu_run.sh build/gpu-run; \
	else echo "test-gpu: skipped: no CUDA device here (tools/gpu_run.sh OUT_DIR --dry-run runs the script without one)"; fi

## Measure how far each chapter's asserted numbers move across instruction sets, thread counts, load (the
## scalar path beside two busy processes) and, for the chapters with training claims, seeds (LABKIT_SEED=1..7);
## ends with each claim's worst headroom over all of them. NB=... for some chapters (hours for all of them).
spread: $(VENV)/.installed-test
	LABKIT_DEVICE=cpu $(BIN)/python tests/claim_spread.py $(NB)

## Unit tests only (fast feedback while editing labkit).
unit: $(VENV)/.installed-test
	LABKIT_DEVICE=cpu OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(JOBS) tests

## Re-execute notebooks in place on the CPU to refresh their stored outputs (NB=notebooks/00_foundations.ipynb for one).
NB ?= notebooks/[0-9]*.ipynb
notebooks: $(VENV)/.installed-test
	LABKIT_DEVICE=cpu OMP_NUM_THREADS=1 $(BIN)/python -m labkit.execute --timeout 300 $(NB)

## Student versions for a class: solutions removed, outputs cleared, written to student/.
student: $(VENV)/.installed-lab
	$(BIN)/python -m labkit.student --out student

## Grade a class: every notebook under $(SUBMISSIONS) (one folder per student) into $(GRADES) + reports/.
grade: $(VENV)/.installed-lab
	LABKIT_DEVICE=cpu $(BIN)/python -m labkit.grade $(SUBMISSIONS) --out $(GRADES) --timeout $(GRADE_TIMEOUT) \
		--jobs $(GRADE_JOBS) $(if $(CHAPTER),--chapter $(CHAPTER),)

clean-venv:
	rm -rf $(VENV)
