"""A small, safe arithmetic language over one variable ``x``, for raw-feature normalizers
(TorchEasyRec's ``normalizer: "method=expression,expr=log(x+3)"``).

Numbers, ``x``, ``+ - * / **``, unary ``-``, and the functions in :data:`FUNCTIONS`. Parsed
once with Python's ``ast`` (nothing is ever ``eval``-ed) and evaluated on NumPy arrays.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

import numpy as np

__all__ = ["FUNCTIONS", "Expression"]

FUNCTIONS: dict[str, Callable[..., np.ndarray]] = {
    "log": np.log,
    "log10": np.log10,
    "log2": np.log2,
    "log1p": np.log1p,
    "exp": np.exp,
    "sqrt": np.sqrt,
    "abs": np.abs,
    "sign": np.sign,
    "sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)),
    "min": np.minimum,
    "max": np.maximum,
    "pow": np.power,
}
_BINARY = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply, ast.Div: np.divide, ast.Pow: np.power}


class Expression:
    """``Expression("log(x+3)")(np.array([1.0]))``; ValueError naming the part it cannot take."""

    def __init__(self, text: str):
        self.text = text
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as e:
            raise ValueError(f"expression {text!r} is not valid ({e.msg})") from None
        self._check(tree.body)
        self._tree = tree.body

    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return
        if isinstance(node, ast.Name) and node.id == "x":
            return
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            self._check(node.left)
            self._check(node.right)
            return
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            self._check(node.operand)
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            if node.func.id not in FUNCTIONS:
                raise ValueError(
                    f"expression {self.text!r}: unknown function '{node.func.id}'; known: {sorted(FUNCTIONS)}"
                )
            for a in node.args:
                self._check(a)
            return
        raise ValueError(
            f"expression {self.text!r}: '{ast.unparse(node)}' is not allowed (numbers, x, + - * / **, and "
            f"the functions {sorted(FUNCTIONS)})"
        )

    def __call__(self, x: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):  # the caller checks the result for finite values
            return np.asarray(self._eval(self._tree, x), dtype=np.float64) * np.ones_like(x)

    def _eval(self, node: ast.AST, x: np.ndarray):
        if isinstance(node, ast.Constant):
            assert isinstance(node.value, (int, float))
            return float(node.value)
        if isinstance(node, ast.Name):
            return x
        if isinstance(node, ast.BinOp):
            return _BINARY[type(node.op)](self._eval(node.left, x), self._eval(node.right, x))
        if isinstance(node, ast.UnaryOp):
            v = self._eval(node.operand, x)
            return -v if isinstance(node.op, ast.USub) else v
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        return FUNCTIONS[node.func.id](*(self._eval(a, x) for a in node.args))
