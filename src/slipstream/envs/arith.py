"""Safe exact arithmetic on untrusted expressions: parsed with `ast`, evaluated over fractions, never `eval`.

Allowed: numbers, parentheses, + - * / // % ** and unary +/-. Sizes are bounded so that an expression cannot
exhaust memory or time (`2 ** 10 ** 10` is refused, not computed).
"""

import ast
import operator
from fractions import Fraction

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 200
MAX_EXPONENT = 256
MAX_BITS = 4096
"""Largest numerator/denominator, in bits, of any intermediate result."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ExpressionError(ValueError):
    """The expression is not allowed arithmetic or cannot be evaluated (message meant for the model)."""


def safe_eval(expression: str) -> Fraction:
    """Exact value of an arithmetic expression."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ExpressionError(f"not a valid expression ({e.msg})") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ExpressionError(f"expression has more than {MAX_NODES} parts")
    return _eval(tree.body)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        elif isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ExpressionError("division by zero")
        return _checked(_BINARY[type(node.op)](left, right))
    raise ExpressionError(f"{ast.unparse(node)!r} is not allowed: only numbers, ( ), + - * / // % ** are")


def _check_power(base: Fraction, exponent: Fraction) -> None:
    if exponent.denominator != 1:
        raise ExpressionError("only whole-number exponents are allowed")
    if abs(exponent) > MAX_EXPONENT:
        raise ExpressionError(f"exponent larger than {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise ExpressionError("division by zero")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length()) * abs(int(exponent))
    if bits > MAX_BITS:
        raise ExpressionError("result too large")


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise ExpressionError("result too large")
    return value


def format_number(value: Fraction) -> str:
    """Integers and terminating decimals exactly; other fractions as a 12-digit decimal plus the exact fraction."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    if denominator == 1:  # terminating decimal: print all of its digits
        digits = 0
        while (value * 10**digits).denominator != 1:
            digits += 1
        scaled = str(abs(value.numerator * 10**digits // value.denominator)).rjust(digits + 1, "0")
        return f"{'-' if value < 0 else ''}{scaled[:-digits]}.{scaled[-digits:]}"
    return f"{float(value):.12g} (exactly {value.numerator}/{value.denominator})"
