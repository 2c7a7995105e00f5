# The README's commands. `make setup` installs the package with its test extras into the current
# Python environment (on a CPU-only machine pin the CPU wheel first: pip install torch==2.13.0).
PY ?= python3

.PHONY: setup run test test-gpu bench lint

setup:
	$(PY) -m pip install -e ".[test,bench,transformers]"

run:  ## the main job: fwd+bwd on a representative shape, checked against the reference, timed
	$(PY) -m tritonattn

test:  ## CPU tier (Triton interpreter when there is no GPU); on a GPU machine the same tests run on CUDA
	$(PY) -m pytest -n 2 -m "not gpu" -q

test-gpu:  ## every test, GPU tier included (needs a CUDA device)
	$(PY) -m pytest -n 8 -q

bench:
	$(PY) -m tritonattn.bench

lint:
	$(PY) -m ruff check tritonattn tests
