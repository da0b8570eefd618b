#!/usr/bin/env bash
# Replaces stock Pillow with Pillow-SIMD (same PIL package, SIMD resize), built with AVX2 where the
# CPU has it. Falls back to stock Pillow, saying so, when the build fails.
set -u
python=${1:-python3}
if "$python" -c "import PIL, sys; sys.exit(0 if '.post' in PIL.__version__ else 1)" 2>/dev/null; then
  echo "Pillow-SIMD: already installed ($("$python" -c 'import PIL; print(PIL.__version__)'))"
  exit 0
fi
flags=""
grep -qw avx2 /proc/cpuinfo 2>/dev/null && flags="-mavx2"
echo "Pillow-SIMD: building from source${flags:+ with $flags} (about a minute)"
"$python" -m pip uninstall -q -y pillow >/dev/null 2>&1
if CC="${CC:-cc} $flags" "$python" -m pip install -q --no-cache-dir --no-binary pillow-simd pillow-simd >/tmp/pillow-simd-build.log 2>&1; then
  echo "Pillow-SIMD: installed ($("$python" -c 'import PIL; print(PIL.__version__)'))"
else
  echo "Pillow-SIMD: build failed (log: /tmp/pillow-simd-build.log); falling back to stock Pillow"
  "$python" -m pip install -q pillow
fi
