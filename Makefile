# Entry points: `make train` (the main job), `make sample` (text from its checkpoint) and
# `make test` (the whole suite, floor check included). Each creates .venv when missing
# and installs the project into it.
PY          := .venv/bin/python
STAMP       := .venv/.installed
FLOOR_PY    := .venv-floor/bin/python
FLOOR_STAMP := .venv-floor/.installed

.PHONY: train sample test lint test-torch test-kernels test-floor wheel bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	# torch first, pinned to the CPU wheel, so the range in pyproject installs nothing more
	# (a bare torch requirement on a machine with no torch pulls a multi-GB CUDA build).
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[train,test,lint]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) scripts/train.py --out-dir out/shakespeare

sample: $(STAMP)
	$(PY) scripts/sample.py --ckpt out/shakespeare --prompt "ROMEO:" --max-new-tokens 300 --top-k 40

# The torch path runs every test; the kernel path reruns the `kernel`-marked tests
# through the Triton interpreter in a second process (the env var must be set
# before triton is imported); the floor check reruns the smoke subset on both paths
# with the oldest torch, triton and numpy that pyproject.toml declares.
test: lint test-torch test-kernels test-floor

# ruff, configured in pyproject.toml: a finding fails the run
lint: $(STAMP)
	.venv/bin/ruff check .

test-torch: $(STAMP)
	$(PY) -m pytest -q

test-kernels: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m kernel

# .venv-floor: the declared floors exactly (tools/floor_env.py reads them from pyproject.toml).
$(FLOOR_STAMP): pyproject.toml tools/floor_env.py
	test -x $(FLOOR_PY) || python3 -m venv .venv-floor
	$(FLOOR_PY) tools/floor_env.py --extra train
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_PY) -m pytest -q -p no:cacheprovider tests/test_floor.py
	TRITON_INTERPRET=1 $(FLOOR_PY) -m pytest -q -p no:cacheprovider tests/test_floor.py

# dist/fuseblock-<version>-py3-none-any.whl; build/ is cleared first so no stale file rides along
wheel: $(STAMP)
	rm -rf build
	$(PY) -m pip wheel --quiet --no-deps . -w dist

bench: $(STAMP)
	$(PY) scripts/bench.py traffic

clean:
	rm -rf .venv .venv-floor out build dist *.egg-info
