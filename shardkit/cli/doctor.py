"""`shardkit doctor`: which codecs and optional parts this installation has."""

from __future__ import annotations

import platform
import sys

from rich.markup import escape
from rich.table import Table

from ..core.codecs import cpu_flags, crop_kernel, header_scanner, pil_build, tar_walker, turbojpeg_problem
from ..core.version import __version__
from .common import console

OPTIONAL = (
    "numpy", "webdataset", "lmdb", "h5py", "PyTurboJPEG", "ray", "torch", "torchvision", "matplotlib", "fsspec", "s3fs",
    "gcsfs", "aiohttp", "av",
)  # fmt: skip
# the pip extra that brings each optional package (pyproject.toml)
EXTRAS = {"ray": "ray", "torch": "torch", "torchvision": "torch", "matplotlib": "plot", "s3fs": "s3", "gcsfs": "gcs",
          "aiohttp": "http", "av": "video"}  # fmt: skip
# Pillow-SIMD replaces Pillow (the same PIL package); it builds from source against libjpeg's headers.
PILLOW_SIMD = (
    "pip uninstall -y pillow && CC='cc -mavx2' pip install --no-cache-dir --no-binary pillow-simd pillow-simd "
    "(needs libjpeg-dev and zlib1g-dev; drop -mavx2 on a CPU without AVX2)"
)
REBUILD = "pip install --force-reinstall --no-deps --no-binary shardkit shardkit (from a checkout: pip install -e .)"


def doctor() -> None:
    """Report the PIL build (Pillow-SIMD or not), libjpeg-turbo, SIMD flags and optional extras."""
    import importlib.metadata  # here: a slow import that only this command needs

    pil = pil_build()
    turbo = turbojpeg_problem()
    table = Table(title=f"shardkit {__version__}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("python", f"{platform.python_version()} ({sys.executable})")
    table.add_row("PIL", f"{'Pillow-SIMD' if pil['simd'] else 'Pillow'} {pil['version']} ({pil['path']})")
    table.add_row("PIL uses libjpeg-turbo", "yes" if pil["libjpeg_turbo"] else "no")
    table.add_row("libturbojpeg (PyTurboJPEG)", "[green]loaded[/]" if turbo is None else f"[yellow]no[/]: {turbo}")
    scanner = "[green]compiled (C)[/]" if header_scanner() else "[yellow]pure Python[/]: no C compiler at install?"
    table.add_row("probe header scanner", scanner)
    walk = "[green]compiled (C)[/]" if tar_walker() else "[yellow]pure Python[/]: no C compiler at install?"
    table.add_row("tar record walk", walk)
    kernel = (
        "[green]compiled (C, libjpeg-turbo)[/]"
        if crop_kernel()
        else "[yellow]Pillow[/]: no C compiler or libjpeg headers at install (apt-get install libjpeg-dev)?"
    )
    table.add_row("loader crop-decode kernel", kernel)
    table.add_row("CPU SIMD flags", " ".join(cpu_flags()) or "none found")
    extras: set[str] = set()
    for name in OPTIONAL:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "[dim]not installed[/]"
            if name in EXTRAS:
                extras.add(EXTRAS[name])
        table.add_row(name, version)
    console.print(table)
    advice = []
    if not pil["simd"]:
        advice.append(f"Pillow-SIMD (faster resizing; stock Pillow is used now): {PILLOW_SIMD}")
    if turbo is not None:
        advice.append(
            "libturbojpeg (fast JPEG decode and encode): apt-get install libturbojpeg0, or your system's package"
        )
    if not header_scanner() or not tar_walker() or not crop_kernel():
        compiled = "the compiled scanner, tar walk and crop kernel"
        advice.append(f"{compiled}: apt-get install gcc libjpeg-dev, then {REBUILD}")
    if extras:
        advice.append(f"optional parts not installed: pip install 'shardkit[{','.join(sorted(extras))}]'")
    for line in advice:
        console.print(f"[dim]to add {escape(line)}[/]", highlight=False)
