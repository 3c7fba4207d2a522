"""A small, safe arithmetic language (TorchEasyRec's / muParser's) over named variables, for
``expr_feature`` and raw-feature normalizers (``normalizer: {expression: "log(x+3)"}``, TorchEasyRec's
``"method=expression,expr=log(x+3)"``: one variable ``x``).

Numbers (``3``, ``.5``, ``1e-3``), variables, the constants ``_pi`` and ``_e``; operators from the
loosest binding to the tightest: ``c ? a : b``, ``||``, ``&&``, ``|``, ``&`` (bitwise, on the
integer parts), ``< <= > >= == !=`` (1 or 0), ``+ -``, ``* /``, a sign (``-x``), ``^`` (power,
right-associative: ``2^3^2 = 2^9``; ``-2^2 = -4``). ``**`` is kept as a synonym of ``^`` (the
language dynarec's normalizers spoke before). The functions are :data:`FUNCTIONS`: muParser's
(``log`` = ``ln`` is the natural log), pyfg's additions, and vector functions over a variable that
holds several numbers a row (``len``, ``dot``, ``l2_norm``, ...).

The text is parsed once by a hand-written precedence-climbing parser (nothing is ever
``eval``-ed) and evaluated on NumPy arrays: a variable is a ``[B]`` array (one number a row) or a
``[B, m]`` array (``m`` numbers a row); arithmetic is element-wise with broadcasting, vector
functions reduce over the ``m`` numbers of a row.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

__all__ = ["EARTH_RADIUS_KM", "FUNCTIONS", "Expression"]

EARTH_RADIUS_KM = 6371.0


def _round_half_away(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _roundp(x, n):
    scale = np.power(10.0, np.trunc(n))
    return _round_half_away(x * scale) / scale


def _haversine(lng1, lat1, lng2, lat2):
    lng1, lat1, lng2, lat2 = (np.radians(v) for v in (lng1, lat1, lng2, lat2))
    a = np.sin((lat2 - lat1) / 2) ** 2 + np.cos(lat1) * np.cos(lat2) * np.sin((lng2 - lng1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * np.arcsin(np.sqrt(np.clip(a, 0.0, 1.0)))


def _sphere_dist(lng1, lat1, lng2, lat2):
    lng1, lat1, lng2, lat2 = (np.radians(v) for v in (lng1, lat1, lng2, lat2))
    c = np.sin(lat1) * np.sin(lat2) + np.cos(lat1) * np.cos(lat2) * np.cos(lng2 - lng1)
    return EARTH_RADIUS_KM * np.arccos(np.clip(c, -1.0, 1.0))


def _fold(fn):
    def apply(*args):
        out = args[0]
        for a in args[1:]:
            out = fn(out, a)
        return out

    return apply


def _rows(v) -> np.ndarray:
    """A value as ``[B, m]`` (a number per row is ``[B, 1]``; a constant ``[1, 1]``)."""
    a = np.asarray(v, dtype=np.float64)
    return a.reshape(1, 1) if a.ndim == 0 else a[:, None] if a.ndim == 1 else a


def _reduce(fn):
    """A vector function: ``fn(values [B, m], axis=1)`` -> one number a row."""
    return lambda v: fn(_rows(v), axis=1)


def _pair(fn):
    """A function of two vectors of one length a row -> one number a row."""

    def apply(a, b):
        a, b = np.broadcast_arrays(_rows(a), _rows(b))
        return fn(a, b)

    return apply


def _corr(a, b):
    da = a - a.mean(axis=1, keepdims=True)
    db = b - b.mean(axis=1, keepdims=True)
    return (da * db).sum(axis=1) / np.sqrt((da * da).sum(axis=1) * (db * db).sum(axis=1))


def _var(ddof: int):
    return lambda v: np.var(_rows(v), axis=1, ddof=ddof)


def _std(ddof: int):
    return lambda v: np.std(_rows(v), axis=1, ddof=ddof)


def _bits(fn):
    return lambda a, b: fn(np.trunc(a).astype(np.int64), np.trunc(b).astype(np.int64)).astype(np.float64)


# name -> (fewest arguments, most arguments (None: any number), function on NumPy arrays)
FUNCTIONS: dict[str, tuple[int, Optional[int], Callable[..., np.ndarray]]] = {
    # muParser's
    "sin": (1, 1, np.sin),
    "cos": (1, 1, np.cos),
    "tan": (1, 1, np.tan),
    "asin": (1, 1, np.arcsin),
    "acos": (1, 1, np.arccos),
    "atan": (1, 1, np.arctan),
    "sinh": (1, 1, np.sinh),
    "cosh": (1, 1, np.cosh),
    "tanh": (1, 1, np.tanh),
    "asinh": (1, 1, np.arcsinh),
    "acosh": (1, 1, np.arccosh),
    "atanh": (1, 1, np.arctanh),
    "log2": (1, 1, np.log2),
    "log10": (1, 1, np.log10),
    "log": (1, 1, np.log),
    "ln": (1, 1, np.log),
    "exp": (1, 1, np.exp),
    "sqrt": (1, 1, np.sqrt),
    "sign": (1, 1, np.sign),
    "rint": (1, 1, np.rint),
    "abs": (1, 1, np.abs),
    "min": (1, None, _fold(np.minimum)),
    "max": (1, None, _fold(np.maximum)),
    "sum": (1, None, _fold(np.add)),
    "avg": (1, None, lambda *a: _fold(np.add)(*a) / len(a)),
    # pyfg's additions
    "isnan": (1, 1, lambda v: np.isnan(v).astype(np.float64)),
    "floor": (1, 1, np.floor),
    "ceil": (1, 1, np.ceil),
    "trunc": (1, 1, np.trunc),
    "round": (1, 1, _round_half_away),
    "roundp": (2, 2, _roundp),
    "mod": (2, 2, np.fmod),
    "sigmoid": (1, 1, lambda v: 1.0 / (1.0 + np.exp(-v))),
    "sphere_dist": (4, 4, _sphere_dist),
    "haversine": (4, 4, _haversine),
    # vector functions: the numbers of a row -> one number
    "len": (1, 1, lambda v: np.full(_rows(v).shape[0], float(_rows(v).shape[1]))),
    "l2_norm": (1, 1, _reduce(lambda v, axis: np.sqrt((v * v).sum(axis=axis)))),
    "squared_norm": (1, 1, _reduce(lambda v, axis: (v * v).sum(axis=axis))),
    "dot": (2, 2, _pair(lambda a, b: (a * b).sum(axis=1))),
    "euclid_dist": (2, 2, _pair(lambda a, b: np.sqrt(((a - b) ** 2).sum(axis=1)))),
    "corr": (2, 2, _pair(_corr)),
    "std_dev": (1, 1, _std(1)),
    "pop_std_dev": (1, 1, _std(0)),
    "variance": (1, 1, _var(1)),
    "pop_variance": (1, 1, _var(0)),
    "reduce_min": (1, 1, _reduce(np.min)),
    "reduce_max": (1, 1, _reduce(np.max)),
    "reduce_sum": (1, 1, _reduce(np.sum)),
    "reduce_mean": (1, 1, _reduce(np.mean)),
    "reduce_prod": (1, 1, _reduce(np.prod)),
    # dynarec's (its normalizers' earlier language)
    "log1p": (1, 1, np.log1p),
    "pow": (2, 2, np.power),
}

CONSTANTS = {"_pi": math.pi, "_e": math.e}


def _cmp(fn):
    return lambda a, b: fn(a, b).astype(np.float64)


def _logic(fn):
    return lambda a, b: fn(np.asarray(a) != 0, np.asarray(b) != 0).astype(np.float64)


# operator -> (binding power, right-associative, function)
_BINARY: dict[str, tuple[int, bool, Callable]] = {
    "||": (1, False, _logic(np.logical_or)),
    "&&": (2, False, _logic(np.logical_and)),
    "|": (3, False, _bits(np.bitwise_or)),
    "&": (4, False, _bits(np.bitwise_and)),
    "<": (5, False, _cmp(np.less)),
    "<=": (5, False, _cmp(np.less_equal)),
    ">": (5, False, _cmp(np.greater)),
    ">=": (5, False, _cmp(np.greater_equal)),
    "==": (5, False, _cmp(np.equal)),
    "!=": (5, False, _cmp(np.not_equal)),
    "+": (6, False, np.add),
    "-": (6, False, np.subtract),
    "*": (7, False, np.multiply),
    "/": (7, False, np.divide),
    "^": (9, True, np.power),
    "**": (9, True, np.power),
}
_SIGN_POWER = 8  # a sign binds tighter than * and /, looser than ^
_TERNARY_POWER = 0

_TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>\|\||&&|<=|>=|==|!=|\*\*|[-+*/^<>()?:,|&]))"
)


# The parsed tree: a number, a variable, a sign, a binary operator, a ternary, a function call.
@dataclass(frozen=True)
class _Num:
    value: float


@dataclass(frozen=True)
class _Var:
    name: str


@dataclass(frozen=True)
class _Neg:
    operand: _Node


@dataclass(frozen=True)
class _Bin:
    op: str
    left: _Node
    right: _Node


@dataclass(frozen=True)
class _If:
    cond: _Node
    then: _Node
    other: _Node


@dataclass(frozen=True)
class _Call:
    name: str
    args: tuple[_Node, ...]


_Node = Union[_Num, _Var, _Neg, _Bin, _If, _Call]


class _Parser:
    def __init__(self, text: str, variables: Optional[Sequence[str]]):
        self.text = text
        self.variables = None if variables is None else set(variables)
        self.tokens: list[tuple[str, str, int]] = []  # (kind, text, position)
        pos = 0
        stripped = text.rstrip()
        while pos < len(stripped):
            m = _TOKEN.match(stripped, pos)
            if m is None or m.end() == pos:
                at = len(stripped) - len(stripped[pos:].lstrip())
                raise self.error(f"unexpected {stripped[at]!r} at position {at}")
            kind = m.lastgroup or "op"
            self.tokens.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()
        self.i = 0

    def error(self, why: str) -> ValueError:
        return ValueError(f"expression {self.text!r}: {why}")

    def peek(self) -> Optional[tuple[str, str, int]]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, text: Optional[str] = None) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None:
            raise self.error("ends too early" + (f" (expected {text!r})" if text else ""))
        if text is not None and tok[1] != text:
            raise self.error(f"expected {text!r} at position {tok[2]}, got {tok[1]!r}")
        self.i += 1
        return tok

    def parse(self) -> _Node:
        if not self.tokens:
            raise self.error("is empty")
        node = self.expression(_TERNARY_POWER)
        tok = self.peek()
        if tok is not None:
            raise self.error(f"unexpected {tok[1]!r} at position {tok[2]}")
        return node

    def expression(self, min_power: int) -> _Node:
        left = self.operand()
        while (tok := self.peek()) is not None and tok[0] == "op":
            op = tok[1]
            if op == "?":
                if min_power > _TERNARY_POWER:
                    break
                self.take()
                then = self.expression(_TERNARY_POWER)
                self.take(":")
                left = _If(left, then, self.expression(_TERNARY_POWER))
                continue
            if op not in _BINARY:
                break
            power, right_assoc, _ = _BINARY[op]
            if power < min_power:
                break
            self.take()
            left = _Bin(op, left, self.expression(power if right_assoc else power + 1))
        return left

    def operand(self) -> _Node:
        kind, text, pos = self.take()
        if kind == "number":
            return _Num(float(text))
        if kind == "name":
            nxt = self.peek()
            if nxt is not None and nxt[1] == "(":
                return self.call(text, pos)
            if text in CONSTANTS:
                return _Num(CONSTANTS[text])
            if self.variables is not None and text not in self.variables:
                known = sorted(self.variables)
                raise self.error(f"unknown variable '{text}'; its variables: {known}, constants _pi, _e")
            return _Var(text)
        if text == "(":
            node = self.expression(_TERNARY_POWER)
            self.take(")")
            return node
        if text in ("-", "+"):
            operand = self.expression(_SIGN_POWER)
            return _Neg(operand) if text == "-" else operand
        raise self.error(f"unexpected {text!r} at position {pos}")

    def call(self, name: str, pos: int) -> _Node:
        if name not in FUNCTIONS:
            raise self.error(f"unknown function '{name}' at position {pos}; known: {sorted(FUNCTIONS)}")
        self.take("(")
        args: list[_Node] = []
        if self.peek() is not None and self.peek()[1] == ")":  # type: ignore[index]
            self.take()
        else:
            while True:
                args.append(self.expression(_TERNARY_POWER))
                if self.take()[1] == ")":
                    break
                self.i -= 1
                self.take(",")
        low, high = FUNCTIONS[name][:2]
        if len(args) < low or (high is not None and len(args) > high):
            want = f"{low}" if low == high else f"{low} or more" if high is None else f"{low} to {high}"
            raise self.error(f"{name}() takes {want} argument(s), got {len(args)}")
        return _Call(name, tuple(args))


def _names(node: _Node) -> set[str]:
    if isinstance(node, _Var):
        return {node.name}
    if isinstance(node, _Neg):
        return _names(node.operand)
    if isinstance(node, _Bin):
        return _names(node.left) | _names(node.right)
    if isinstance(node, _If):
        return _names(node.cond) | _names(node.then) | _names(node.other)
    if isinstance(node, _Call):
        return set().union(*(_names(a) for a in node.args)) if node.args else set()
    return set()


class Expression:
    """``Expression("log(x+3)")(np.array([1.0]))``; ``Expression("a ^ 2 + b", ["a", "b"])
    .evaluate({"a": ..., "b": ...})``. ValueError naming the part it cannot take (an unknown
    function or variable, a wrong number of arguments, a syntax error and its position)."""

    def __init__(self, text: str, variables: Optional[Sequence[str]] = ("x",)):
        self.text = text
        self._tree = _Parser(text, variables).parse()
        self.names = frozenset(_names(self._tree))  # the variables it reads

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The normalizer form: one variable ``x``, ``[B]`` in, ``[B]`` out."""
        return self.evaluate({"x": x}, rows=len(x))

    def evaluate(self, env: Mapping[str, np.ndarray], rows: int) -> np.ndarray:
        """The value for ``rows`` rows, each variable of ``env`` a ``[rows]`` or ``[rows, m]``
        float64 array: ``[rows]`` where the result is one number a row, else ``[rows, m]``.
        Non-finite results are left to the caller to name."""
        with np.errstate(all="ignore"):
            out = np.asarray(self._eval(self._tree, env), dtype=np.float64)
        if out.ndim == 2 and out.shape[1] == 1:
            out = out[:, 0]
        return np.broadcast_to(out, (rows, *out.shape[1:])).copy() if out.ndim <= 1 else out

    def _eval(self, node: _Node, env: Mapping[str, np.ndarray]):
        if isinstance(node, _Num):
            return node.value
        if isinstance(node, _Var):
            v = np.asarray(env[node.name], dtype=np.float64)
            return v[:, None] if v.ndim == 1 and any(np.ndim(x) == 2 for x in env.values()) else v
        if isinstance(node, _Neg):
            return -np.asarray(self._eval(node.operand, env))
        if isinstance(node, _Bin):
            return _BINARY[node.op][2](self._eval(node.left, env), self._eval(node.right, env))
        if isinstance(node, _If):
            cond = np.asarray(self._eval(node.cond, env))
            return np.where(cond != 0, self._eval(node.then, env), self._eval(node.other, env))
        assert isinstance(node, _Call)
        fn = FUNCTIONS[node.name][2]
        out = fn(*(self._eval(a, env) for a in node.args))
        if node.name in _VECTOR and any(np.ndim(x) == 2 for x in env.values()):
            out = np.asarray(out)[:, None]  # one number a row, in a [B, m] world
        return out


_VECTOR = frozenset(
    [
        "len",
        "l2_norm",
        "squared_norm",
        "dot",
        "euclid_dist",
        "corr",
        "std_dev",
        "pop_std_dev",
        "variance",
        "pop_variance",
        "reduce_min",
        "reduce_max",
        "reduce_sum",
        "reduce_mean",
        "reduce_prod",
    ]
)
