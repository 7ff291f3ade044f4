#!/usr/bin/env bash
# Installs what fsdp.cpp needs to build, non-interactively and idempotently.
#
#   - Debian packages: compiler tool chain, CMake, Ninja, ccache, Abseil, fmt, spdlog, CLI11,
#     nlohmann-json, yaml-cpp, GoogleTest/GoogleMock, gloo's headers (libgloo-dev) and clang-14
#     with its libFuzzer/sanitizer runtimes (libclang-rt-14-dev; for fuzz/ only).
# FSDP_SKIP_APT=1 skips the Debian part; FSDP_TORCH_DIR=<site-packages/torch> skips the wheel.
#   - libtorch: the PyPI wheel torch==$FSDP_TORCH_VERSION in a virtualenv OUTSIDE the clone
#     ($FSDP_CACHE_DIR, default ~/.cache/fsdp.cpp), shared by every clone and CI run on the
#     machine. The wheel is several GB; it is installed once. Next to it: safetensors, numpy
#     (tests), matplotlib (bench/plot.py) and transformers (tests/hf_llama_e2e_test.cc; it does
#     not depend on torch, so the pinned wheel stays); a venv made before one of them was added
#     gets it.
#
# On a machine where it already ran it only checks stamps and returns in about a second.
# It prints the torch directory on its last line of stdout ("torch_dir=...") for the Makefile.
set -euo pipefail

TORCH_VERSION="${FSDP_TORCH_VERSION:-2.11.0}"
CACHE_DIR="${FSDP_CACHE_DIR:-$HOME/.cache/fsdp.cpp}"
VENV="$CACHE_DIR/venv-torch-$TORCH_VERSION"
STAMP="$VENV/.fsdp-bootstrap-ok"
# Python packages installed with torch, by import name (= pip name for these). A venv counts as
# complete when the stamp exists and each has its package directory (checked with a glob, no
# python or pip started, so a second run stays at a few milliseconds).
PY_PACKAGES=(safetensors numpy matplotlib transformers)

say() { echo "[bootstrap] $*" >&2; }
die() { echo "[bootstrap] error: $*" >&2; exit 1; }

# --- Debian packages ------------------------------------------------------------------------
DEB_PACKAGES=(build-essential cmake ninja-build ccache pkg-config python3-venv
  libabsl-dev libfmt-dev libspdlog-dev libcli11-dev nlohmann-json3-dev libyaml-cpp-dev
  libgtest-dev libgmock-dev libgloo-dev
  clang-14 libclang-rt-14-dev  # fuzz/: clang's libFuzzer, ASan and UBSan runtimes
  openmpi-bin)  # only for the test that runs our programs under a real mpirun

if [ "${FSDP_SKIP_APT:-0}" = 1 ]; then DEB_PACKAGES=(); fi
missing=()
for p in "${DEB_PACKAGES[@]}"; do
  # python3-venv is only needed when no usable python venv module exists (pyenv pythons ship it).
  if [ "$p" = python3-venv ] && python3 -c 'import venv, ensurepip' 2>/dev/null; then continue; fi
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "need root (or sudo) to install: ${missing[*]}"
    SUDO="sudo -n"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || die "apt-get update failed"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    die "apt-get install failed for: ${missing[*]}"
fi

# --- libtorch from the PyPI wheel -----------------------------------------------------------
find_torch_dir() {
  "$VENV/bin/python" - <<'EOF'
import importlib.util, os
spec = importlib.util.find_spec("torch")
print(os.path.dirname(spec.origin))
EOF
}

if [ -n "${FSDP_TORCH_DIR:-}" ]; then
  # A torch already installed elsewhere (e.g. the GPU machine's python3): use it as is.
  [ -f "$FSDP_TORCH_DIR/lib/libtorch_cpu.so" ] ||
    die "FSDP_TORCH_DIR=$FSDP_TORCH_DIR has no lib/libtorch_cpu.so"
  echo "torch_dir=$FSDP_TORCH_DIR"
  exit 0
fi

if [ ! -f "$STAMP" ]; then
  mkdir -p "$CACHE_DIR"
  command -v python3 >/dev/null || die "python3 not found (needed to install the torch wheel)"
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtualenv $VENV"
    python3 -m venv "$VENV" || die "python3 -m venv $VENV failed"
  fi
  say "installing torch==$TORCH_VERSION from PyPI into $VENV (several GB, once per machine)"
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
      "torch==$TORCH_VERSION" "${PY_PACKAGES[@]}"; then
    die "pip could not install torch==$TORCH_VERSION; fsdp.cpp does not fall back to another libtorch"
  fi
  tdir=$(find_torch_dir)
  [ -f "$tdir/lib/libtorch_cpu.so" ] || die "torch wheel at $tdir has no lib/libtorch_cpu.so"
  [ -d "$tdir/include/torch/csrc/distributed/c10d" ] || die "torch wheel at $tdir has no c10d headers"
  echo "$tdir" > "$STAMP"
  say "torch $TORCH_VERSION ready at $tdir"
fi

missing_py=()
for m in "${PY_PACKAGES[@]}"; do
  compgen -G "$VENV/lib/python3*/site-packages/$m/__init__.py" >/dev/null || missing_py+=("$m")
done
if [ ${#missing_py[@]} -gt 0 ]; then
  say "installing ${missing_py[*]} into $VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${missing_py[@]}" ||
    die "pip could not install: ${missing_py[*]}"
fi

echo "torch_dir=$(cat "$STAMP")"
