# fsdp.cpp entry points. `make test` on a fresh clone installs, builds and runs everything.
#   make build   bootstrap (Debian packages + torch wheel, once per machine), configure, build
#   make test    build, then the whole suite through ctest (labels: unit, multirank, gpu)
#   make train   build, then train the tiny default GPT (configs/default.yaml); TRAIN_ARGS adds
#                options, e.g. TRAIN_ARGS="--set training.steps=50"
#   make gpu-check  on a GPU machine: scripts/gpu_check.sh (GPU tests, llama_1b benchmarks)
#   make sanitize-test  the suite built with AddressSanitizer and UBSan in build-asan (not part
#                of make test: a build from scratch and a slower suite); reports also land in
#                build-asan/sanitizer-logs/ (every rank's process writes its own);
#                SANITIZE=thread: with ThreadSanitizer instead, in build-tsan
#   make format  clang-format -i (the repo's .clang-format) on the .cc/.h/.cu files changed
#                since main: committed on this branch and not yet committed
#   make clean   remove the build folder
# Knobs: BUILD_DIR, JOBS, CTEST_ARGS (e.g. CTEST_ARGS="-L unit"), FSDP_TORCH_DIR (skip the
# wheel install and use this site-packages/torch), FSDP_CUDA_MODE=auto|on|off.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CTEST_ARGS ?=
FSDP_CUDA_MODE ?= auto

.PHONY: all build test train bootstrap configure clean gpu-check sanitize-test format

all: build

bootstrap:
	@scripts/bootstrap.sh > $(BUILD_DIR).bootstrap.out || (rm -f $(BUILD_DIR).bootstrap.out; exit 1)

# The torch the build uses, as a shell expression: FSDP_TORCH_DIR, else what bootstrap installed.
TORCH_DIR = $${FSDP_TORCH_DIR:-$$(sed -n 's/^torch_dir=//p' $(BUILD_DIR).bootstrap.out)}

configure: bootstrap
	@torch_dir="$(TORCH_DIR)"; \
	if [ ! -f $(BUILD_DIR)/build.ninja ] || ! grep -qF "FSDP_TORCH_DIR:PATH=$$torch_dir" $(BUILD_DIR)/CMakeCache.txt; then \
	  cmake -S . -B $(BUILD_DIR) -G Ninja -DFSDP_TORCH_DIR="$$torch_dir" -DFSDP_CUDA_MODE=$(FSDP_CUDA_MODE); \
	fi

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

train: build
	$(BUILD_DIR)/bin/fsdp train configs/default.yaml $(TRAIN_ARGS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 300 $(CTEST_ARGS)

# On a machine with a GPU: build with its torch, ctest -L gpu, llama_1b runs, one table.
gpu-check:
	scripts/gpu_check.sh

# The CPU build (no CUDA code, no fuzz harnesses: fuzz/ has its own sanitized build) with
# -fsanitize=$(SANITIZE). address,undefined: the first report of either stops that process.
# thread: libtorch, OpenMP and Gloo are not instrumented, so ThreadSanitizer cannot see their
# atomics order anything, and their own accesses (a tensor or a Work freed on Gloo's thread,
# ATen's copies on OpenMP's) would read as races with ours: reports are kept to instrumented
# code (ignore_noninstrumented_modules) and ATen's ops run on the calling thread
# (OMP_NUM_THREADS=1; offload's host loops keep threads of their own: FSDP_OFFLOAD_HOST_THREADS).
# Package.InstallBuildRun is left out: the project it builds against the installed libraries
# links without the sanitizers' runtimes.
SANITIZE ?= address,undefined
SANITIZE_LOGS = $(abspath $(SANITIZE_DIR))/sanitizer-logs
ifeq ($(SANITIZE),thread)
SANITIZE_DIR ?= build-tsan
SANITIZE_ENV = OMP_NUM_THREADS=1 FSDP_OFFLOAD_HOST_THREADS=3 \
  TSAN_OPTIONS=ignore_noninstrumented_modules=1:log_path=$(SANITIZE_LOGS)/tsan
else
SANITIZE_DIR ?= build-asan
SANITIZE_ENV = ASAN_OPTIONS=log_path=$(SANITIZE_LOGS)/asan \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$(SANITIZE_LOGS)/ubsan
endif
sanitize-test: bootstrap
	@torch_dir="$(TORCH_DIR)"; \
	cmake -S . -B $(SANITIZE_DIR) -G Ninja -DFSDP_TORCH_DIR="$$torch_dir" -DFSDP_CUDA_MODE=off \
	  -DFSDP_FUZZ=OFF -DFSDP_SANITIZE=$(SANITIZE) >/dev/null
	cmake --build $(SANITIZE_DIR) -j $(JOBS)
	rm -rf $(SANITIZE_LOGS) && mkdir -p $(SANITIZE_LOGS)
	@cd $(SANITIZE_DIR) && $(SANITIZE_ENV) \
	  ctest --output-on-failure -j $(JOBS) --timeout 900 -E '^Package[.]' $(CTEST_ARGS); \
	rc=$$?; reports=$$(ls $(SANITIZE_LOGS)); \
	for f in $$reports; do echo "==== $(SANITIZE_LOGS)/$$f"; head -40 "$(SANITIZE_LOGS)/$$f"; done; \
	[ $$rc -eq 0 ] && [ -z "$$reports" ]

# Files changed in commits not yet on main and in the working tree, that still exist.
format:
	@command -v clang-format >/dev/null || { echo "clang-format not found: apt-get install clang-format"; exit 1; }
	@files=$$( { git diff --name-only main...HEAD; git diff --name-only HEAD; } | sort -u | \
	  grep -E '\.(cc|h|cu)$$' | while read -r f; do [ -f "$$f" ] && echo "$$f"; done); \
	if [ -z "$$files" ]; then echo "make format: no changed .cc/.h/.cu files"; \
	else echo "$$files" | xargs clang-format -i --style=file && echo "$$files" | sed 's/^/formatted: /'; fi

clean:
	rm -rf $(BUILD_DIR) $(BUILD_DIR).bootstrap.out
