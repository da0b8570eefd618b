"""What `pip install shardkit` users get: an sdist that carries the license and what its own tests
read, built by setuptools' real PEP 517 hook from a copy of this tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what the tests open beside themselves (tests/test_architecture.py, test_cli_pack.py, test_fuzz.py)
READ_BY_TESTS = ["docs/ARCHITECTURE.md", "configs/imagenet-256.toml", "scripts/fuzz_shards.py", "tests/conftest.py"]


def test_the_sdist_carries_the_license_and_what_its_tests_read(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    # .hypothesis: the other test worker's hypothesis runs write and rename files there meanwhile
    ignore = shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".*cache", ".hypothesis"
    )
    shutil.copytree(ROOT, tree, ignore=ignore)
    built = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"],
        cwd=tree, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    sdist = tmp_path / built.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    sources = {"shardkit/core/_crop.c", "shardkit/core/_scan.c", "shardkit/core/_tar.c"}
    assert {"LICENSE", "pyproject.toml", "setup.py", *sources} <= names
    assert set(READ_BY_TESTS) <= names
    assert not [name for name in names if name.endswith((".so", ".pyc"))]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
