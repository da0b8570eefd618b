"""One way to say why an error happened: core.errors.describe, used by every message that names a cause."""

from __future__ import annotations

import errno
import struct

from shardkit.core.errors import describe


def test_an_os_error_in_its_own_words_without_the_path() -> None:
    error = FileNotFoundError(errno.ENOENT, "No such file or directory", "/secret/place.jpg")
    assert describe(error) == "No such file or directory"
    assert describe(error, with_type=True).startswith("FileNotFoundError: ")


def test_the_first_line_of_a_long_message_and_never_more_than_300_characters() -> None:
    stack = OSError("Unable to open file (file signature not found)\n  HDF5-DIAG: Error detected in ...\n")
    assert describe(stack) == "Unable to open file (file signature not found)"
    assert len(describe(ValueError("x" * 5000))) == 300
    assert describe(ValueError("\n\n  second line first  \n")) == "second line first"


def test_a_message_that_means_little_alone_keeps_its_type() -> None:
    try:
        struct.unpack(">I", b"\0")
    except struct.error as error:
        assert describe(error, with_type=True).startswith("error: unpack requires")
    assert describe(KeyError()) == "KeyError" and describe(RuntimeError(""), with_type=True) == "RuntimeError"
