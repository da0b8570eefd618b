#!/usr/bin/env bash
# Installs Debian/Ubuntu packages shardkit benefits from, when it can (root or passwordless sudo).
# Everything still works without them: Pillow decodes JPEG (slower) and stock Pillow is used.
set -u
packages=(libturbojpeg0 libjpeg-dev zlib1g-dev libwebp-dev libtiff-dev)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && { echo "system packages: all present (${packages[*]})"; exit 0; }
if ! command -v apt-get >/dev/null; then
  echo "system packages: no apt-get here; install libjpeg-turbo yourself for fast JPEG (missing: ${missing[*]})"
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else
  echo "system packages: not root and no passwordless sudo; please install: ${missing[*]}"
  exit 0
fi
echo "system packages: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq "${missing[@]}" >/dev/null \
  || echo "system packages: apt-get failed; continuing without ${missing[*]}"
