#!/usr/bin/env bash
# Set up tierlm in ./.venv:  ./install.sh  (the server)  or  ./install.sh test  (and the tests).
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "test" ] && extras="[test]"

# MLX's Linux CPU backend is slow on its bundled reference BLAS; tierlm loads
# OpenBLAS instead when it is there (tierlm/cpu_blas.py). Debian/Ubuntu package:
blas="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libopenblas.so.0"
if [ "$(uname -s)" = "Linux" ] && [ ! -e "$blas" ] && command -v apt-get >/dev/null; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "installing OpenBLAS (libopenblas0-pthread) for MLX's CPU backend"
  $sudo apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q libopenblas0-pthread >/dev/null; } \
    || echo "warning: OpenBLAS not installed; tierlm will run on MLX's slow reference BLAS"
fi

python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e ".${extras}"
echo "tierlm installed in .venv"
