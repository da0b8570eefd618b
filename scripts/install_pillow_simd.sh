#!/usr/bin/env bash
# Replaces stock Pillow with Pillow-SIMD (same PIL package, SIMD resize), built with AVX2 where the
# CPU has it. The wheel is built once and kept beside the venv, so re-running `make install` (which
# lets pip put stock Pillow back for shardkit's own `Pillow` requirement) swaps it in again in seconds.
# Falls back to stock Pillow, saying so, when the build fails.
set -u
python=${1:-python3}
if "$python" -c "import PIL, sys; sys.exit(0 if '.post' in PIL.__version__ else 1)" 2>/dev/null; then
  echo "Pillow-SIMD: already installed ($("$python" -c 'import PIL; print(PIL.__version__)'))"
  exit 0
fi
cache=$(cd "$(dirname "$python")/.." && pwd)/pillow-simd-wheel
if ! ls "$cache"/pillow_simd-*.whl >/dev/null 2>&1; then
  flags=""
  grep -qw avx2 /proc/cpuinfo 2>/dev/null && flags="-mavx2"
  echo "Pillow-SIMD: building a wheel${flags:+ with $flags} (about a minute, once)"
  rm -rf "$cache"
  if ! CC="${CC:-cc} $flags" "$python" -m pip wheel -q --no-cache-dir --no-deps --no-binary pillow-simd pillow-simd -w "$cache" \
      >/tmp/pillow-simd-build.log 2>&1; then
    echo "Pillow-SIMD: build failed (log: /tmp/pillow-simd-build.log); keeping stock Pillow"
    "$python" -c "import PIL" 2>/dev/null || "$python" -m pip install -q pillow
    exit 0
  fi
fi
# Both distributions own the PIL folder: remove both before installing one, or files go missing.
"$python" -m pip uninstall -q -y pillow pillow-simd >/dev/null 2>&1
if "$python" -m pip install -q --no-deps --force-reinstall "$cache"/pillow_simd-*.whl \
    && "$python" -c "import PIL.Image" 2>/dev/null; then
  echo "Pillow-SIMD: installed ($("$python" -c 'import PIL; print(PIL.__version__)'))"
else
  echo "Pillow-SIMD: install failed; falling back to stock Pillow"
  "$python" -m pip install -q --force-reinstall pillow
fi
