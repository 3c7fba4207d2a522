"""The reader of a ``pipeline.config``'s messages: every field must be taken by a handler, else
it is refused by path (so a field nobody handles can never pass silently)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from dynarec.config.textproto import Message, Scalar

__all__ = ["Context", "Reader", "one_of"]


class Context:
    """What a conversion found: notes (mapped and ignored fields) and refusals (``path: why``).
    A *fatal* refusal is one ``--lenient`` cannot drop (the model itself, a feature group the
    model needs): the conversion fails on it either way."""

    def __init__(self, lenient: bool, output_dir: Optional[Path] = None):
        self.lenient = lenient
        # The YAML's directory, which dynarec resolves relative paths against; the config's
        # own data paths are relative to the current directory (TorchEasyRec's). None: as given.
        self.output_dir = output_dir
        self.notes: list[str] = []
        self.refused: list[str] = []
        self.fatal: list[str] = []

    def refuse(self, path: str, why: str = "not supported", *, fatal: bool = False) -> None:
        self.refused.append(f"{path}: {why}")
        if fatal:
            self.fatal.append(f"{path}: {why}")

    def note(self, path: str, text: str) -> None:
        self.notes.append(f"{path}: {text}")


def _integer(value: Any) -> int:
    """``value`` if it is an int64 integer; ValueError saying why not."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {_shown(value)}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{_shown(value)} does not fit int64")
    return value


def _number(value: Any) -> float:
    """``value`` as a finite float; ValueError saying why not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {_shown(value)}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"{_shown(value)} is not a finite number")
    return x


def _shown(value: Any) -> str:
    """A value as an error message quotes it (at most 40 characters)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"


class Reader:
    """One message being converted: every field must be taken by a handler, else it is
    refused when :meth:`done` runs (so a field nobody handles can never pass silently)."""

    def __init__(self, msg: Message, path: str, ctx: Context):
        self.msg, self.path, self.ctx = msg, path, ctx
        self.taken: set[str] = set()

    def at(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def has(self, name: str) -> bool:
        return bool(self.msg.values(name))

    def scalar(self, name: str, default: Any = None) -> Any:
        self.taken.add(name)
        values = self.msg.values(name)
        if not values:
            return default
        # A field given twice with one value: protobuf's text_format.Merge (TorchEasyRec's
        # reader) keeps the last; any other repetition is refused.
        if isinstance(values[0], Message) or any(v != values[0] for v in values[1:]):
            self.ctx.refuse(self.at(name), "expected one value")
            return default
        return values[0]

    def integer(self, name: str, default: Any = None) -> Any:
        """An integer field (``16.5``, ``"16"``, ``true`` or a number past int64 are refused by
        path; the default, or 0, is returned in their place so conversion lists every refusal)."""
        value = self.scalar(name, default)
        return default if value is default else self._checked(_integer, value, self.at(name), default, 0)

    def number(self, name: str, default: Any = None) -> Any:
        """A finite number field (an integer is taken as one; ``1e999``, ``nan`` and strings are
        refused by path)."""
        value = self.scalar(name, default)
        return default if value is default else self._checked(_number, value, self.at(name), default, 0.0)

    def integers(self, name: str) -> list[int]:
        """A repeated integer field; a value that is not one is refused by its path."""
        return [self._checked(_integer, v, f"{self.at(name)}[{i}]", 0, 0) for i, v in enumerate(self.repeated(name))]

    def numbers(self, name: str) -> list[float]:
        """A repeated finite-number field; a value that is not one is refused by its path."""
        return [self._checked(_number, v, f"{self.at(name)}[{i}]", 0.0, 0.0) for i, v in enumerate(self.repeated(name))]

    def _checked(self, convert, value: Any, path: str, default: Any, fallback: Any) -> Any:
        try:
            return convert(value)
        except ValueError as e:
            self.ctx.refuse(path, str(e))
            return fallback if default is None else default

    def string(self, name: str, default: Any = None) -> Any:
        """A string (or enum name) field as ``str``; ``default`` when absent."""
        value = self.scalar(name, default)
        return value if value is default else str(value)

    def strings(self, name: str) -> list[str]:
        return [str(v) for v in self.repeated(name)]

    def repeated(self, name: str) -> list[Scalar]:
        self.taken.add(name)
        values = self.msg.values(name)
        if any(isinstance(v, Message) for v in values):
            self.ctx.refuse(self.at(name), "expected values, got a block")
            return []
        return values  # type: ignore[return-value]

    def message(self, name: str) -> Optional[Reader]:
        found = self.messages(name)
        if len(found) > 1:
            self.ctx.refuse(self.at(name), "given more than once")
        return found[0] if found else None

    def messages(self, name: str) -> list[Reader]:
        self.taken.add(name)
        out = []
        values = self.msg.values(name)
        for i, v in enumerate(values):
            if not isinstance(v, Message):
                self.ctx.refuse(self.at(name), "expected a block")
                continue
            out.append(Reader(v, self.at(name) + (f"[{i}]" if len(values) > 1 else ""), self.ctx))
        return out

    def default_only(self, name: str, default: Any, why: str = "not supported", *, fatal: bool = False) -> None:
        """A field dynarec has no setting for: accepted at TorchEasyRec's default, else refused."""
        value = self.scalar(name, default)
        if value != default:
            self.ctx.refuse(self.at(name), f"{why} (only {default!r}, its default, is)", fatal=fatal)

    def refuse(self, *names: str, why: str = "not supported", fatal: bool = False) -> None:
        """Fields dynarec has nothing for: taken, and refused when given."""
        for name in names:
            self.taken.add(name)
            if self.msg.values(name):
                self.ctx.refuse(self.at(name), why, fatal=fatal)

    def ignore(self, name: str, why: str) -> None:
        """A field with no effect on what is trained here: taken, with a note when given."""
        self.taken.add(name)
        if self.msg.values(name):
            self.ctx.note(self.at(name), f"ignored ({why})")

    def done(self) -> None:
        for name in self.msg.names():
            if name not in self.taken:
                self.ctx.refuse(self.at(name))


def one_of(r: Reader, names: tuple[str, ...]) -> Optional[tuple[str, Reader]]:
    given = [n for n in names if r.has(n)]
    for n in names:
        r.taken.add(n)
    if len(given) != 1:
        r.ctx.refuse(r.path, f"give exactly one of {list(names)} (got {given or 'none'})")
        return None
    sub = r.message(given[0])
    assert sub is not None
    return given[0], sub
