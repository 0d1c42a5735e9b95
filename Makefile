# Two entry points: `make train` (the main job) and `make test` (the whole suite).
# Each creates .venv when missing and installs the project into it.
PY      := .venv/bin/python
STAMP   := .venv/.installed

.PHONY: train test test-torch test-kernels bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	# torch first, pinned to the CPU wheel, so the range in pyproject installs nothing more
	# (a bare torch requirement on a machine with no torch pulls a multi-GB CUDA build).
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[train,test]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) scripts/train.py --out-dir out/shakespeare

# The torch path runs every test; the kernel path reruns the `kernel`-marked tests
# through the Triton interpreter in a second process (the env var must be set
# before triton is imported).
test: test-torch test-kernels

test-torch: $(STAMP)
	$(PY) -m pytest -q

test-kernels: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m kernel

bench: $(STAMP)
	$(PY) scripts/bench.py traffic

clean:
	rm -rf .venv out build *.egg-info
