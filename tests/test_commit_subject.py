"""scripts/check_commit_subject.py, the commit-msg hook: subjects over 72 characters are refused."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_commit_subject.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_commit_subject", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("message", "ok"),
    [
        ("x" * 72, True),
        ("x" * 73, False),
        ("x" * 72 + "\n\n" + "a body line may be longer than the subject " * 5, True),
        ("# a comment git strips, longer than 72 characters " * 3 + "\n\nshort subject\n", True),
        ("\n\n" + "x" * 73 + "\n", False),  # leading blank lines: the subject is still the first text
        ("x" * 72 + "   \n", True),  # trailing spaces do not count
        ("é" * 72, True),  # characters, not bytes
        ("", True),  # git itself refuses an empty message
    ],
)
def test_the_subject_is_at_most_72_characters(check, message: str, ok: bool) -> None:
    assert (check.problem(message) is None) is ok


def test_the_hook_exits_1_and_says_why(tmp_path: Path) -> None:
    message = tmp_path / "COMMIT_EDITMSG"
    message.write_text("y" * 80 + "\n\nbody\n", encoding="utf-8")
    refused = subprocess.run([sys.executable, str(SCRIPT), str(message)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "80 characters, at most 72" in refused.stderr
    message.write_text("a subject that fits\n", encoding="utf-8")
    passed = subprocess.run([sys.executable, str(SCRIPT), str(message)], capture_output=True, text=True, timeout=60)
    assert passed.returncode == 0 and passed.stderr == ""


def test_pre_commit_runs_it_at_the_commit_msg_stage() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}
    assert "scripts/check_commit_subject.py" in hooks["commit-subject"]["entry"]
    assert hooks["commit-subject"]["stages"] == ["commit-msg"]
    assert "commit-msg" in config["default_install_hook_types"]
    # the other hooks check files, not the message: not at the commit-msg stage
    assert all("commit-msg" not in hook.get("stages", config["default_stages"]) for name, hook in hooks.items()
               if name != "commit-subject")  # fmt: skip
