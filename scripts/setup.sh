#!/usr/bin/env bash
# One-time set-up, run by `make` before anything else: system library, virtualenv, pinned install.
# Idempotent; re-run it after pyproject.toml changes (make does that for you).
set -euo pipefail
cd "$(dirname "$0")/.."

# open3d (and open3d-cpu) load libusb-1.0.so.0 at import time.
if ! ldconfig -p 2>/dev/null | grep -q 'libusb-1.0.so.0'; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing libusb-1.0-0 (needed by open3d)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libusb-1.0-0 >/dev/null
  elif command -v sudo >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing libusb-1.0-0 (needed by open3d) with sudo"
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libusb-1.0-0 >/dev/null
  else
    echo "setup: open3d needs the system library libusb-1.0.so.0." >&2
    echo "       Install it (Debian/Ubuntu: apt-get install libusb-1.0-0; Fedora: dnf install libusb1) and re-run." >&2
    exit 1
  fi
fi

# Chromium, optional: only the browser tests use it (tests/test_report_browser.py skips without it).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing chromium (headless browser for the report tests)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
        >/dev/null; } || echo "setup: chromium did not install; the browser tests will be skipped" >&2
  elif command -v sudo >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    echo "setup: installing chromium (headless browser for the report tests) with sudo"
    { sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium >/dev/null; } || echo "setup: chromium did not install; the browser tests will be skipped" >&2
  else
    echo "setup: no chromium: the browser tests of the report will be skipped." >&2
    echo "       To run them, install it (Debian: apt-get install chromium; Ubuntu: a chromium snap or" >&2
    echo "       Google Chrome) or point CHROMIUM=/path/to/chrome at one." >&2
  fi
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
echo "setup: installing the project and its pinned dependencies into .venv (a few minutes the first time)"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/python -c "import torch, open3d, pycolmap, prefect, dvc, cuda.bindings, tensorboard" \
  || { echo "setup: an installed package fails to import (see above)" >&2; exit 1; }
touch .venv/.installed
echo "setup: done"
