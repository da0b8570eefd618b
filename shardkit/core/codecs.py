"""Which codecs and compiled parts this machine has: libjpeg-turbo through PyTurboJPEG, which PIL
build, the header scanner (`_scan`), the tar record walk (`_tar`) and the crop-decode kernel (`_crop`), the
CPU's SIMD flags."""

from __future__ import annotations

import functools
import os
from typing import Any

# The DCT scale factors libjpeg-turbo reduces fastest at; its other M/8 factors are slower than a full decode.
DCT_FACTORS = ((1, 8), (1, 4), (1, 2))


@functools.cache
def turbojpeg() -> Any | None:
    """A TurboJPEG handle, or None when the library or the binding is missing (Pillow is used then).

    Set SHARDKIT_NO_TURBOJPEG=1 to force the Pillow path (for comparisons and tests).
    """
    if os.environ.get("SHARDKIT_NO_TURBOJPEG"):
        return None
    try:
        from turbojpeg import TurboJPEG

        return TurboJPEG()
    except (ImportError, OSError, RuntimeError):
        return None


def turbojpeg_problem() -> str | None:
    """Why libjpeg-turbo is not in use, or None when it is."""
    if os.environ.get("SHARDKIT_NO_TURBOJPEG"):
        return "disabled by SHARDKIT_NO_TURBOJPEG"
    try:
        from turbojpeg import TurboJPEG

        TurboJPEG()
    except ImportError:
        return "the PyTurboJPEG package is not installed"
    except (OSError, RuntimeError) as error:
        return f"libturbojpeg not found ({error}); on Debian/Ubuntu: apt-get install libturbojpeg0"
    return None


@functools.cache
def header_scanner() -> Any | None:
    """The compiled header scanner (shardkit.core._scan), or None when it was not built.

    Set SHARDKIT_NO_CSCAN=1 to force the pure-Python parser (for comparisons and tests).
    """
    if os.environ.get("SHARDKIT_NO_CSCAN"):
        return None
    try:
        from . import _scan  # type: ignore[attr-defined]  # a C extension with no stub, maybe not built

        return _scan
    except ImportError:
        return None


@functools.cache
def tar_walker() -> Any | None:
    """The compiled tar record walk of the WebDataset reader (shardkit.core._tar), or None when it was not
    built (formats/webdataset then walks the headers in Python, with the same results).

    Set SHARDKIT_NO_CTAR=1 to force the pure-Python walk (for comparisons and tests).
    """
    if os.environ.get("SHARDKIT_NO_CTAR"):
        return None
    try:
        from . import _tar  # type: ignore[attr-defined]  # a C extension with no stub, maybe not built

        return _tar
    except ImportError:
        return None


@functools.cache
def crop_kernel() -> Any | None:
    """The compiled crop-decode kernel of the batch loader (shardkit.core._crop), or None when it was not
    built (no compiler or no libjpeg headers at install: the loader then goes through Pillow).

    Set SHARDKIT_NO_CROP_KERNEL=1 to force the Pillow path (for comparisons and tests).
    """
    if os.environ.get("SHARDKIT_NO_CROP_KERNEL"):
        return None
    try:
        from . import _crop  # type: ignore[attr-defined]  # a C extension with no stub, maybe not built

        return _crop
    except ImportError:
        return None


def pil_build() -> dict[str, Any]:
    import PIL

    version = PIL.__version__
    return {
        "version": version,
        "simd": ".post" in version,  # Pillow-SIMD versions carry a .postN suffix
        "libjpeg_turbo": _pil_has_libjpeg_turbo(),
        "path": os.path.dirname(PIL.__file__),
    }


def _pil_has_libjpeg_turbo() -> bool:
    # The flag PIL.features reads, from Pillow's C module itself: PIL.features imports PIL.Image,
    # which a pack's driver (its resume settings name the codec) otherwise never needs.
    try:
        from PIL import _imaging

        return bool(_imaging.HAVE_LIBJPEGTURBO)
    except (ImportError, AttributeError):  # a Pillow without the flag: ask it the long way
        from PIL import features

        return bool(features.check_feature("libjpeg_turbo"))


@functools.cache
def write_codec() -> str:
    """Which libjpeg the write side uses: Pillow's own when it is libjpeg-turbo (it decodes and encodes
    straight into its image buffer, so it beats PyTurboJPEG's numpy round trip), else PyTurboJPEG
    when it loads, else Pillow. SHARDKIT_WRITE_CODEC=pillow|pyturbojpeg forces one (for tests and
    comparisons)."""
    forced = os.environ.get("SHARDKIT_WRITE_CODEC")
    if forced in ("pillow", "pyturbojpeg"):
        return forced if forced == "pillow" or turbojpeg() is not None else "pillow"
    if pil_build()["libjpeg_turbo"] or turbojpeg() is None:
        return "pillow"
    return "pyturbojpeg"


def cpu_flags() -> list[str]:
    wanted = ("sse4_1", "sse4_2", "avx", "avx2", "avx512f", "neon", "asimd")
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in wanted if flag in present]
    except OSError:
        pass
    return []


# Images are opened only as the formats shardkit handles: Pillow's other plugins (EPS runs
# Ghostscript, DDS raises NotImplementedError) are not an attack surface a reader of strangers'
# files needs.
RECORD_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM")
