#!/usr/bin/env bash
# What a pip user gets on another Python: a fresh venv, `pip install .` (no make, no extras, stock
# Pillow), both C extensions required to have built, and the core tests run against the installed
# package (a copy of tests/ beside pyproject.toml's pytest settings, away from the source tree).
# usage: scripts/pip_smoke.sh /path/to/python3.X
set -euo pipefail
python=$1
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$root" pytest pytest-timeout hypothesis
cp -r "$root/tests" "$root/pyproject.toml" "$work/"
cd "$work"
echo "pip install . on $("$work/venv/bin/python" --version): running the core tests against it"
SHARDKIT_REQUIRE_EXTENSIONS=1 "$work/venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/test_formats.py tests/test_readers.py tests/test_scanner.py tests/test_manifest.py tests/test_verify.py \
  tests/test_loader.py tests/test_resume.py tests/test_cli_probe.py tests/test_hostile.py tests/test_duplicates.py
