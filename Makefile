# Two commands do everything on a fresh machine:
#   make demo   set up .venv and run the main job on its built-in default
#   make test   set up .venv and run the test suite
# On a CUDA machine: make setup DEVICE=cuda (torch's CUDA build, which brings Triton; FBGEMM's
# CPU build and torchrec are for CPU machines), then `dynarec train ... --device cuda`.
PYTHON ?= python3
DEVICE ?= cpu
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

# torchrec 1.8.0 declares a dependency on fbgemm-gpu (the CUDA build), which overwrites the CPU
# build and then fails to import; so torchrec goes in with --no-deps, its other dependencies by
# name, and FBGEMM's CPU build last.
TORCHREC_DEPS := tensordict==0.15.3 torchmetrics==1.0.3 tqdm==4.70.1 pyre-extensions==0.0.32

.PHONY: setup demo test bench clean

$(VENV)/.installed-cpu: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps torchrec==1.8.0
	$(PIP) install -q $(TORCHREC_DEPS)
	$(PIP) install -q -e '.[fbgemm,dev,interpreter]'
	$(PY) -c "import torch, fbgemm_gpu, torchrec; print('torch', torch.__version__, '| fbgemm_gpu', fbgemm_gpu.__version__, '| torchrec', torchrec.__version__)"
	$(PY) -c "from dynarec.kernels import cpu; cpu.build(); print('dynarec CPU kernels built')"
	$(PY) -c "from dynarec.features import native; native.build(); print('dynarec feature-generation kernels built')"
	touch $@

# PyPI's Linux torch wheels are CUDA builds and depend on the Triton release they were built with.
$(VENV)/.installed-cuda: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PY) -c "import torch, triton; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
	$(PY) -c "from dynarec.features import native; native.build(); print('dynarec feature-generation kernels built')"
	touch $@

setup: $(VENV)/.installed-$(DEVICE)

demo: setup
	$(VENV)/bin/dynarec demo $(if $(filter cuda,$(DEVICE)),--device cuda)

test: setup
	$(VENV)/bin/ruff check dynarec tests benchmarks
	$(VENV)/bin/ruff format --check dynarec tests benchmarks
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

bench: setup
	$(VENV)/bin/dynarec bench suite --device $(DEVICE)

clean:
	rm -rf $(VENV)
