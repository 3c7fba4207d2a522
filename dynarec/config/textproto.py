"""Protocol Buffers text format (``pipeline.config`` files), read without their .proto schema.

A message is an ordered list of ``(field, value)``; a value is a scalar (str, int, float, bool,
or an enum name as :class:`Enum`) or a nested :class:`Message`. Repeated fields appear once per
value (``[a, b]`` lists are expanded). What a field means is the reader's business
(:mod:`dynarec.config.tzrec`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

__all__ = ["Enum", "Message", "TextFormatError", "parse"]


class TextFormatError(ValueError):
    """The text is not valid protobuf text format; the message names the line."""


class Enum(str):
    """An unquoted identifier value (an enum name such as ``FG_DAG``)."""


Scalar = Union[str, int, float, bool, Enum]


@dataclass
class Message:
    fields: list[tuple[str, Union[Scalar, Message]]] = field(default_factory=list)

    def names(self) -> list[str]:
        return list(dict.fromkeys(name for name, _ in self.fields))

    def values(self, name: str) -> list[Union[Scalar, Message]]:
        return [v for n, v in self.fields if n == name]


_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>[-+]?(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)[fF]?)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>[{}<>\[\]:,;])
    """,
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f", "v": "\v"}


def _unescape(body: str, line: int) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif nxt in "xX":
            m = re.match(r"[0-9a-fA-F]{1,2}", body[i + 2 :])
            if not m:
                raise TextFormatError(f"line {line}: bad \\x escape")
            out.append(chr(int(m.group(), 16)))
            i += 2 + len(m.group())
        elif nxt in "01234567":
            m = re.match(r"[0-7]{1,3}", body[i + 1 :])
            assert m is not None
            out.append(chr(int(m.group(), 8)))
            i += 1 + len(m.group())
        elif nxt in "uU":
            width = 4 if nxt == "u" else 8
            digits = body[i + 2 : i + 2 + width]
            if not re.fullmatch(f"[0-9a-fA-F]{{{width}}}", digits) or int(digits, 16) > 0x10FFFF:
                raise TextFormatError(
                    f"line {line}: bad \\{nxt} escape {body[i : i + 2 + width]!r} ({width} hex digits of a code point)"
                )
            out.append(chr(int(digits, 16)))
            i += 2 + width
        else:
            raise TextFormatError(f"line {line}: unknown escape \\{nxt}")
    return "".join(out)


def _tokens(text: str) -> list[tuple[str, str, int]]:
    out, pos, line = [], 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise TextFormatError(f"line {line}: unexpected character {text[pos]!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind != "ws":
            out.append((kind, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return out


# Nesting deeper than this is refused (protobuf's own parsers stop at 100 too).
MAX_DEPTH = 100
# Integers longer than Python converts by default (sys.int_info.default_max_str_digits).
_MAX_DIGITS = 4300


class _Parser:
    def __init__(self, text: str):
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, str, int]:
        return self.toks[self.i] if self.i < len(self.toks) else ("eof", "", self.toks[-1][2] if self.toks else 1)

    def take(self, value: str | None = None) -> tuple[str, str, int]:
        tok = self.peek()
        if value is not None and tok[1] != value:
            raise TextFormatError(f"line {tok[2]}: expected '{value}', got '{tok[1] or 'end of file'}'")
        self.i += 1
        return tok

    def message(self, end: str | None) -> Message:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise TextFormatError(f"line {self.peek()[2]}: messages nested more than {MAX_DEPTH} deep")
        try:
            return self._fields(end)
        finally:
            self.depth -= 1

    def _fields(self, end: str | None) -> Message:
        msg = Message()
        while True:
            kind, text, line = self.peek()
            if end is not None and text == end:
                self.take()
                return msg
            if kind == "eof":
                if end is not None:
                    raise TextFormatError(f"line {line}: missing '{end}'")
                return msg
            if kind != "ident":
                raise TextFormatError(f"line {line}: expected a field name, got '{text}'")
            self.take()
            name = text
            colon = self.peek()[1] == ":"
            if colon:
                self.take()
            nxt = self.peek()[1]
            if nxt in ("{", "<"):
                self.take()
                msg.fields.append((name, self.message("}" if nxt == "{" else ">")))
            elif nxt == "[":
                self.take()
                while self.peek()[1] != "]":
                    if self.peek()[1] in ("{", "<"):
                        close = "}" if self.take()[1] == "{" else ">"
                        msg.fields.append((name, self.message(close)))
                    else:
                        msg.fields.append((name, self.scalar()))
                    if self.peek()[1] == ",":
                        self.take()
                self.take("]")
            elif not colon:
                raise TextFormatError(f"line {line}: expected ':' or '{{' after '{name}'")
            else:
                msg.fields.append((name, self.scalar()))
            if self.peek()[1] in (",", ";"):
                self.take()

    def scalar(self) -> Scalar:
        kind, text, line = self.take()
        if kind == "string":
            value = _unescape(text[1:-1], line)
            while self.peek()[0] == "string":  # adjacent strings concatenate
                _, more, more_line = self.take()
                value += _unescape(more[1:-1], more_line)
            return value
        if kind == "number":
            if len(text) > _MAX_DIGITS:
                raise TextFormatError(f"line {line}: a number of {len(text)} digits")
            t = text.rstrip("fF") if not text.lower().startswith(("0x", "-0x", "+0x")) else text
            if re.fullmatch(r"[-+]?(0[xX][0-9a-fA-F]+)", t):
                return int(t, 16)
            if re.fullmatch(r"[-+]?\d+", t) and not text.endswith(("f", "F")):
                return int(t)
            return float(t)
        if kind == "ident":
            if text in ("true", "True", "t"):
                return True
            if text in ("false", "False", "f"):
                return False
            if text.lower() in ("inf", "infinity", "nan"):
                return float(text)
            return Enum(text)
        if text == "-" or text == "+":
            raise TextFormatError(f"line {line}: a sign must be followed by a number")
        raise TextFormatError(f"line {line}: expected a value, got '{text}'")


def parse(text: str) -> Message:
    """The top-level message of a protobuf text-format document."""
    return _Parser(text).message(None)
