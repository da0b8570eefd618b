"""Only the optional C extensions live here; all other metadata is in pyproject.toml."""

from setuptools import Extension, setup

# optional=True: without a C compiler (or, for _crop, without libjpeg's headers: apt-get install
# libjpeg-dev) the install still succeeds and shardkit uses its pure-Python paths, with the same
# results, slower; `shardkit doctor` says which.
setup(
    ext_modules=[
        Extension("shardkit.core._scan", ["shardkit/core/_scan.c"], optional=True, extra_compile_args=["-O2"]),
        Extension("shardkit.core._tar", ["shardkit/core/_tar.c"], optional=True, extra_compile_args=["-O2"]),
        Extension(
            "shardkit.core._crop", ["shardkit/core/_crop.c"], libraries=["jpeg"], optional=True, extra_compile_args=["-O3"]
        ),
    ]
)
