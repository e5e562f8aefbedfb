"""``calculator``: arithmetic on numbers, parsed with ``ast`` and evaluated node by node (never
``eval``): ``+ - * / // % **``, unary signs and parentheses. Anything else (names, calls,
attributes) is refused, and so are powers whose result would be huge."""

from __future__ import annotations

import ast
import math
import operator

from unirl.tools.registry import register_tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
#: The largest exponent and base size accepted for ``**``: 10**100 is fine, 9**9**9 is a denial of service.
_MAX_EXPONENT = 1000
_MAX_DIGITS = 4300  # Python's own limit for int -> str


@register_tool("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return the result."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    tree = ast.parse(expression.strip(), mode="eval")
    value = _evaluate(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"the result is not finite ({value})")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
    return str(value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > _MAX_EXPONENT or len(str(int(abs(left)))) > 100):
            raise ValueError(f"power too large: {left} ** {right}")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, int) and result.bit_length() > _MAX_DIGITS * 3.33:
            raise ValueError("the result is too large")
        return result
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses only)")
