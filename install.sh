#!/usr/bin/env bash
# Set up tierlm in ./.venv:  ./install.sh  (the server)  or  ./install.sh test  (and the tests).
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "test" ] && extras="[test]"

# MLX's Linux CPU backend is slow on its bundled reference BLAS and its quantized
# matmul; tierlm loads OpenBLAS instead when it is there, behind a small C route,
# and multiplies quantized weights with its own kernels behind a C++ hook, both
# compiled by itself (tierlm/backends/cpu/). Debian/Ubuntu packages:
packages=""
blas="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libopenblas.so.0"
[ -e "$blas" ] || packages="libopenblas0-pthread"
command -v cc >/dev/null || packages="${packages:+$packages }gcc libc6-dev"
command -v c++ >/dev/null || packages="${packages:+$packages }g++"
# the tests drive the dashboard in a headless Chromium (tests/test_dashboard.py)
if [ -n "$extras" ]; then
  command -v chromium >/dev/null || packages="${packages:+$packages }chromium"
  command -v chromedriver >/dev/null || packages="${packages:+$packages }chromium-driver"
fi
if [ "$(uname -s)" = "Linux" ] && [ -n "$packages" ] && command -v apt-get >/dev/null; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "installing $packages"
  $sudo apt-get install -y -q $packages >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q $packages >/dev/null; } \
    || echo "warning: not installed ($packages): without OpenBLAS or a compiler tierlm runs on a slower CPU path; without chromium the dashboard's browser test is skipped"
fi

python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e ".${extras}"
echo "tierlm installed in .venv"
