#!/usr/bin/env bash
# fuzz/run_fuzzer.sh BUILD_DIR NAME SECONDS [libFuzzer flags...]
#   NAME: safetensors | metadata. Writes fresh seeds (fsdp_fuzz_seeds) into
#   BUILD_DIR/fuzz/work/NAME/seeds and fuzzes for SECONDS with the harness of the sanitized
#   build, growing the corpus in BUILD_DIR/fuzz/work/NAME/corpus (kept between runs). Exit 0: no
#   finding; otherwise the input is BUILD_DIR/fuzz/work/NAME/crash-* (or timeout-*, oom-*), to
#   replay with: FSDP_FUZZ_CHECKPOINT=BUILD_DIR/fuzz/work/NAME/seeds/checkpoint \
#     ASAN_OPTIONS=detect_leaks=0 BUILD_DIR/fuzz/sanitized/fsdp_fuzz_NAME CRASH_FILE
#   Examples: fuzz/run_fuzzer.sh build metadata 30
#             fuzz/run_fuzzer.sh build safetensors 0 -runs=1000000     # a count, not a time
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 BUILD_DIR NAME SECONDS [libFuzzer flags...]" >&2; exit 2; }
build=$(cd "$1" && pwd); name=$2; seconds=$3; shift 3
fuzzer="$build/fuzz/sanitized/fsdp_fuzz_$name"
[ -x "$fuzzer" ] || { echo "$0: no $fuzzer (fuzz targets not built: see cmake's output)" >&2; exit 2; }
work="$build/fuzz/work/$name"
mkdir -p "$work/corpus"
"$build/bin/fsdp_fuzz_seeds" "$work/seeds" >/dev/null

# detect_leaks=0: libtorch keeps static allocations (allocator caches, thread pools, registries)
# that LeakSanitizer reports at exit; our code's leaks are not what this run looks for.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:symbolize=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export FSDP_FUZZ_CHECKPOINT="$work/seeds/checkpoint"
# One input must finish within a second (-timeout=1: a hang is a finding); a single allocation
# above 2 GiB, or 2 GiB resident, is a finding too (libFuzzer's default -rss_limit_mb=2048).
exec "$fuzzer" -timeout=1 -max_total_time="$seconds" -dict="$(dirname "$0")/json.dict" \
  -artifact_prefix="$work/" -print_final_stats=1 -detect_leaks=0 "$@" \
  "$work/corpus" "$work/seeds/$name"
