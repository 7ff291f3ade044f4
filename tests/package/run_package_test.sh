#!/usr/bin/env bash
# ctest Package.InstallBuildRun: installs this build to a prefix, configures and builds
# tests/package (a project of its own: find_package(fsdp_cpp)) against it, and runs it on 2
# ranks with the installed `fsdp launch`. Prints how long each phase took.
#   run_package_test.sh <fsdp build dir> <fsdp source dir>
# The prefix and the outside build live at fixed paths under the build dir (wiped first), so
# ccache recognises the outside project's one translation unit from one run to the next.
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
work="$build/package_test"
rm -rf "$work/prefix" "$work/build"
mkdir -p "$work"

phase() {  # phase NAME command...: runs it, prints its wall time, fails with its output
  local name=$1 start=$SECONDS
  shift
  if ! "$@" > "$work/$name.log" 2>&1; then
    echo "FAILED: $name: $*"; cat "$work/$name.log"; exit 1
  fi
  echo "$name: $((SECONDS - start)) s"
}

launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
phase install cmake --install "$build" --prefix "$work/prefix"
for f in lib/cmake/fsdp_cpp/fsdp_cppConfig.cmake lib/cmake/fsdp_cpp/fsdp_cppConfigVersion.cmake \
         include/sharding/fsdp_model.h include/models/gpt/gpt.h lib/libfsdp_engine.a bin/fsdp; do
  [[ -e "$work/prefix/$f" ]] || { echo "FAILED: the install has no $f"; exit 1; }
done
phase configure cmake -S "$src/tests/package" -B "$work/build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$work/prefix" "${launcher[@]}"
phase build cmake --build "$work/build"
# The installed fsdp starts the ranks (torchrun's environment, rendezvous on a free port).
phase run "$work/prefix/bin/fsdp" launch --nproc-per-node 2 -- "$work/build/package_app"
cat "$work/run.log"
grep -q "losses match the unsharded reference on 2 ranks" "$work/run.log" ||
  { echo "FAILED: no 'losses match' line from rank 0"; exit 1; }
