"""A condition over index.parquet's columns written as text (`shardkit remove --where`), made a
pyarrow Expression by a small parser of its own: the text may come from anyone, so it is never
evaluated as Python, and pyarrow has no parser of expressions from text.

    condition  := term ("or" term)*
    term       := factor ("and" factor)*
    factor     := "not" factor | "(" condition ")" | test
    test       := column ("==" | "!=" | "<" | "<=" | ">" | ">=") value
                | column ["not"] "in" "(" value ("," value)* ")"
                | column ("startswith" | "endswith" | "contains") text
                | column "is" ["not"] "null"
    value      := a number | text in '...' or "..." (a backslash escapes the quote) | true | false

    label == 3 and source startswith 'artist-118/'
    key in ('n01440764/img_1', 'n01440764/img_2') or width < 64
"""

from __future__ import annotations

import re
from typing import Any

from ..core.errors import ConfigError

MAX_TEXT = 100_000  # a condition longer than this is refused before it is read
MAX_DEPTH = 64  # parentheses and "not"s within one another (each a level of the parser's recursion)
_TOKEN = re.compile(
    r"""\s*(?:(?P<number>-?\d{1,18}(?:\.\d{1,18})?(?:[eE][-+]?\d{1,3})?)(?![\w.])|(?P<text>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
    r"""|(?P<op>==|!=|<=|>=|<|>|\(|\)|,)|(?P<word>[A-Za-z_][A-Za-z0-9_]*))""",
    re.ASCII,  # (a digit is 0-9, not any script's)
)
_COMPARE = {"==": "equal", "!=": "not_equal", "<": "less", "<=": "less_equal", ">": "greater", ">=": "greater_equal"}
_TEXT_TESTS = {"startswith": "starts_with", "endswith": "ends_with", "contains": "match_substring"}
_WORDS = {"and", "or", "not", "in", "is", "null", "true", "false", *_TEXT_TESTS}


def parse_where(text: str) -> Any:
    """The pyarrow Expression `text` says; ConfigError naming where it stops making sense."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError('--where: needs a condition, e.g. "label == 3"')
    if len(text) > MAX_TEXT:
        raise ConfigError(f"--where: a condition of at most {MAX_TEXT:,} characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("--where: the condition is not valid UTF-8 text") from None
    parser = _Parser(text, _tokens(text))
    expression = parser.condition()
    if parser.at < len(parser.tokens):
        parser.fail("an end, or 'and' / 'or'")
    return expression


def _tokens(text: str) -> list[tuple[str, str, int]]:
    found: list[tuple[str, str, int]] = []
    at = 0
    while at < len(text):
        if text[at:].strip() == "":
            break
        match = _TOKEN.match(text, at)
        if match is None or match.end() == at:
            raise ConfigError(f"--where: cannot read {text[at:].strip()[:20]!r} (at character {at + 1})")
        kind = match.lastgroup or ""
        found.append((kind, match.group(kind), match.start(kind)))
        at = match.end()
    return found


class _Parser:
    def __init__(self, text: str, tokens: list[tuple[str, str, int]]) -> None:
        self.text, self.tokens, self.at, self.depth = text, tokens, 0, 0

    def fail(self, wanted: str) -> None:
        if self.at >= len(self.tokens):
            raise ConfigError(f"--where: the condition ends where {wanted} should follow")
        _, value, where = self.tokens[self.at]
        raise ConfigError(f"--where: {value[:40]!r} at character {where + 1}, where {wanted} should be")

    def peek(self, *values: str) -> bool:
        return self.at < len(self.tokens) and self.tokens[self.at][1].lower() in values

    def take(self, *values: str) -> str:
        if not self.peek(*values):
            self.fail(" or ".join(repr(value) for value in values))
        self.at += 1
        return self.tokens[self.at - 1][1].lower()

    def condition(self) -> Any:
        result = self.term()
        while self.peek("or"):
            self.at += 1
            result = result | self.term()
        return result

    def term(self) -> Any:
        result = self.factor()
        while self.peek("and"):
            self.at += 1
            result = result & self.factor()
        return result

    def factor(self) -> Any:
        if self.peek("not", "("):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                self.fail(f"at most {MAX_DEPTH} parentheses and 'not's within one another")
            try:
                if self.take("not", "(") == "not":
                    return ~self.factor()
                inner = self.condition()
                self.take(")")
                return inner
            finally:
                self.depth -= 1
        return self.test()

    def test(self) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        if self.at >= len(self.tokens) or self.tokens[self.at][0] != "word" or self.peek(*_WORDS):
            self.fail("a column name")
        column = pc.field(self.tokens[self.at][1])
        self.at += 1
        if self.peek(*_COMPARE):
            operator = _COMPARE[self.take(*_COMPARE)]
            return getattr(pc, operator)(column, pc.scalar(self.value()))
        if self.peek("not", "in"):
            negated = self.take("not", "in") == "not"
            if negated:
                self.take("in")
            self.take("(")
            values = [self.value()]
            while self.peek(","):
                self.at += 1
                values.append(self.value())
            self.take(")")
            kinds = {bool if type(value) is bool else str if isinstance(value, str) else float for value in values}
            if len(kinds) > 1:
                raise ConfigError(
                    "--where: the values of an 'in' list must be all numbers, all texts or all true/false"
                )
            # a null is neither in nor out of a list, as in SQL (isin alone says "not in", and "not in"
            # would take every record without a label)
            member = pc.if_else(column.is_null(), pc.scalar(pa.scalar(None, pa.bool_())), column.isin(values))
            return ~member if negated else member
        if self.peek(*_TEXT_TESTS):
            test = _TEXT_TESTS[self.take(*_TEXT_TESTS)]
            pattern = self.value()
            if not isinstance(pattern, str):
                self.at -= 1
                self.fail("a text in quotes")
            return getattr(pc, test)(column, pattern=pattern)
        if self.peek("is"):
            self.at += 1
            negated = self.peek("not")
            if negated:
                self.at += 1
            self.take("null")
            return column.is_valid() if negated else column.is_null()
        self.fail("==, !=, <, <=, >, >=, in, startswith, endswith, contains or is")
        raise AssertionError  # (fail raises)

    def value(self) -> Any:
        if self.at >= len(self.tokens):
            self.fail("a value")
        kind, value, _ = self.tokens[self.at]
        if kind == "number":
            self.at += 1
            return float(value) if any(c in value for c in ".eE") else int(value)
        if kind == "text":
            self.at += 1
            return re.sub(r"\\(.)", r"\1", value[1:-1])
        if kind == "word" and value.lower() in ("true", "false"):
            self.at += 1
            return value.lower() == "true"
        self.fail("a value (a number, or a text in quotes)")
        raise AssertionError
