"""The commit-msg hook (.pre-commit-config.yaml): a commit's subject line is at most 72 characters.

usage: python scripts/check_commit_subject.py MESSAGE_FILE

The subject is the message's first line that is neither blank nor a comment (git strips those after
the hook runs). Exit code 1, with the subject and its length, when it is longer.
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_SUBJECT = 72


def subject(message: str) -> str:
    """The first line that git keeps: not blank, not a `#` comment; "" for an empty message."""
    for line in message.splitlines():
        if line.strip() and not line.startswith("#"):
            return line.rstrip()
    return ""


def problem(message: str) -> str | None:
    """Why the message's subject is refused, or None."""
    line = subject(message)
    if len(line) > MAX_SUBJECT:
        return f"commit subject is {len(line)} characters, at most {MAX_SUBJECT}: {line!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    refused = problem(Path(args[0]).read_text(encoding="utf-8", errors="replace"))
    if refused is not None:
        print(refused, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
