"""`shardkit doctor`: which codecs and optional parts this installation has."""

from __future__ import annotations

import platform
import sys

from rich.table import Table

from ..core.codecs import cpu_flags, crop_kernel, header_scanner, pil_build, turbojpeg_problem
from ..core.version import __version__
from .common import console

OPTIONAL = (
    "numpy", "webdataset", "lmdb", "h5py", "PyTurboJPEG", "ray", "torch", "torchvision", "matplotlib", "fsspec", "s3fs",
    "gcsfs", "aiohttp",
)  # fmt: skip


def doctor() -> None:
    """Report the PIL build (Pillow-SIMD or not), libjpeg-turbo, SIMD flags and optional extras."""
    import importlib.metadata  # here: ~50 ms that only this command needs

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
    kernel = (
        "[green]compiled (C, libjpeg-turbo)[/]"
        if crop_kernel()
        else "[yellow]Pillow[/]: no C compiler or libjpeg headers at install (apt-get install libjpeg-dev)?"
    )
    table.add_row("loader crop-decode kernel", kernel)
    table.add_row("CPU SIMD flags", " ".join(cpu_flags()) or "none found")
    for name in OPTIONAL:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "[dim]not installed[/]"
        table.add_row(name, version)
    console.print(table)
    if not pil["simd"]:
        console.print("[dim]Pillow-SIMD is not installed: resizing uses stock Pillow (slower); see make install.[/]")
