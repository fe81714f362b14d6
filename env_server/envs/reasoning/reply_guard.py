"""Keeping replies that are code away from the reasoning-gym scorers that would run them.

Seven hosted scorers execute the reply: given ``__import__('pathlib').Path(p).touch()`` they
create ``p`` (measured for every dataset; intermediate_integration and polynomial_multiplication,
not hosted, do too):

* binary_matrix, n_queens, spiral_matrix, string_insertion ``eval()`` a reply that is not the
  answer, for partial credit when it is a Python list. Here such a reply reaches them only if it
  is a Python literal (``ast.literal_eval`` parses it), which ``eval`` cannot turn into a call.
* countdown, puzzle24, simple_integration parse the reply with ``sympy.parse_expr``, which
  ``eval``s it. Here it must be arithmetic: numbers, names, ``+ - * /`` and ``**`` with a small
  exponent; no calls, attributes, subscripts or strings. Their answers are exactly that (sums and
  products of numbers, antiderivatives of polynomials), so nothing a correct reply says is lost,
  and ``Integral(f, x)``, which simple_integration's scorer would take as the antiderivative of
  ``f``, is refused with the rest.

A refused reply scores 0 without reaching the scorer. Powers are bounded because Python computes
an integer power in full, holding the GIL: ``9**9**9`` would stall the whole server.
"""

from __future__ import annotations

import ast
from typing import Any

EVALS_THE_REPLY = frozenset({"binary_matrix", "n_queens", "spiral_matrix", "string_insertion"})
PARSES_THE_REPLY_WITH_SYMPY = frozenset({"countdown", "puzzle24", "simple_integration"})
MAX_EXPONENT = 1000
MAX_POWER_DIGITS = 10_000  # (4300-digit number)**1000 took 3.5 s here; a 10,000-digit power takes µs
_UNPARSABLE = (SyntaxError, ValueError, TypeError, MemoryError, RecursionError)


def may_score(dataset: str, answer: str, entry: dict[str, Any]) -> bool:
    """True when ``dataset``'s scorer may see ``answer`` without running code it holds."""
    if dataset in EVALS_THE_REPLY:
        # these scorers return before their eval() for the answer (n_queens: any valid answer)
        exact = answer == entry["answer"] or answer in entry["metadata"].get("valid_answers", ())
        return exact or is_literal(answer)
    if dataset in PARSES_THE_REPLY_WITH_SYMPY:
        return is_arithmetic(answer)
    return True


def is_literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
    except _UNPARSABLE:
        return False
    return True


def is_arithmetic(text: str) -> bool:
    """Numbers and names combined with ``+ - * /``, and ``**`` as :func:`_power_ok` allows."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except _UNPARSABLE:
        return False
    return _arithmetic(tree.body)


def _arithmetic(node: ast.AST) -> bool:
    match node:
        case ast.Constant(value=value):
            return type(value) in (int, float, complex)
        case ast.Name(id=name):
            return not name.startswith("_")
        case ast.UnaryOp(op=ast.UAdd() | ast.USub(), operand=operand):
            return _arithmetic(operand)
        case ast.BinOp(op=ast.Pow(), left=base, right=exponent):
            return _power_ok(base, exponent)
        case ast.BinOp(op=ast.Add() | ast.Sub() | ast.Mult() | ast.Div(), left=left, right=right):
            return _arithmetic(left) and _arithmetic(right)
    return False


def _power_ok(base: ast.AST, exponent: ast.AST) -> bool:
    """A base without powers in it, raised to a name or to a number (or a ratio of two, as in
    ``x**(3/2)``) of at most :data:`MAX_EXPONENT`, small enough to compute when both are numbers."""
    if any(isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) for node in ast.walk(base)):
        return False
    if not _arithmetic(base):
        return False
    if isinstance(exponent, ast.UnaryOp) and isinstance(exponent.op, ast.UAdd | ast.USub):
        exponent = exponent.operand
    if isinstance(exponent, ast.Name):
        return not exponent.id.startswith("_")
    value = _number(exponent)
    if value is None or abs(value) > MAX_EXPONENT:
        return False
    # An upper bound on the base's digits: its numbers' digits, plus one per operation.
    digits = sum(len(str(node.value)) + 1 for node in ast.walk(base) if isinstance(node, ast.Constant))
    return digits * abs(value) <= MAX_POWER_DIGITS


def _number(node: ast.AST) -> float | None:
    """The value of a real number or of a ratio of two, else None."""
    match node:
        case ast.Constant(value=value) if type(value) in (int, float):
            return value
        case ast.BinOp(op=ast.Div(), left=ast.Constant(value=top), right=ast.Constant(value=bottom)):
            if type(top) in (int, float) and type(bottom) in (int, float) and bottom:
                return top / bottom
    return None
