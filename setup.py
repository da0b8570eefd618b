"""Only the optional C extension lives here; all other metadata is in pyproject.toml."""

from setuptools import Extension, setup

# optional=True: without a C compiler the install still succeeds and probe uses the pure-Python
# parser (slower; `shardkit doctor` says so).
setup(
    ext_modules=[
        Extension("shardkit._scan", ["shardkit/_scan.c"], optional=True, extra_compile_args=["-O2"])
    ]
)
