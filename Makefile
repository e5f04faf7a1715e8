# One-command set-up on a fresh machine. See README.md.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# CPU machines: install the CPU build of torch 2.13.0 first (a bare `torch` pulls a multi-GB CUDA build);
# with an NVIDIA GPU, let pip resolve torch>=2.11 normally.
TORCH_CPU ?= torch==2.13.0

.PHONY: venv test bench reproduce ablate clean

# `make reproduce` trains the cpu preset (<= 30 min on 2 cores) into results/cpu-local/ and prints, last, its
# tables compared cell by cell with the committed reference results/cpu/ and the paper; PRESET=smoke: the CI one.
PRESET ?= cpu

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(VPY) -m pip install -q "$(TORCH_CPU)"; fi
	$(VPY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

test: venv
	OMP_NUM_THREADS=2 $(VPY) -m pytest -q tests

# glibc returns every freed tensor above 32 MB to the kernel, so each step page-faults its
# buffers in again and CPU timings swing by +-30 %; keeping freed memory in the heap (what a
# caching allocator does) makes the comparison stable. See docs/benchmarks.md.
BENCH_ENV ?= MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000

bench: venv
	$(BENCH_ENV) OMP_NUM_THREADS=2 $(VENV)/bin/lrmoe bench layer --threads 2 --out results/bench

reproduce: venv
	$(VENV)/bin/lrmoe reproduce --preset $(PRESET)

# `make ablate`: the ablation grids that fit 2 CPU cores, one after another (docs/ablations.md: cost);
# `make ablate GRIDS=quota` runs one. Runs, tables and figures: results/ablations-local/<grid>/ (git-ignored;
# the committed reference is results/ablations/<grid>/).
GRIDS ?= heldout drop_ratio quota mask_vs_compact unbiased phi

ablate: venv
	for g in $(GRIDS); do $(VENV)/bin/lrmoe ablate ablations/$$g.toml || exit $$?; done

clean:
	rm -rf $(VENV) build *.egg-info
