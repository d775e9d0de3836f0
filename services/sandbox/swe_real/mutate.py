"""AST-level bug injection (the SWE-smith approach): each mutation changes one node of a source
file and leaves every other character as it was, so the bug is a small, local edit.

Kinds: `flip_compare` (a comparison operator to its opposite or neighbour: < to <=, == to !=,
in to not in, is to is not), `off_by_one` (an integer constant c to c + 1 or c - 1, in an index,
slice, range or arithmetic), `remove_branch` (an if's condition to False, so its branch never
runs), `swap_args` (the first two positional arguments of a call swapped)."""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass

_FLIP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}


@dataclass(frozen=True)
class Mutation:
    path: str  # the file, relative to the project root
    kind: str
    line: int
    before: str  # the source segment replaced
    after: str  # what replaced it
    start: int  # character offsets of the segment in the original file
    end: int

    def apply(self, source: str) -> str:
        assert source[self.start : self.end] == self.before, (
            "the file is not the one the mutation was made for"
        )
        return source[: self.start] + self.after + source[self.end :]


def _offsets(source: str) -> list[int]:
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _segment(source: str, lines: list[int], node: ast.AST) -> tuple[int, int]:
    # ast columns are UTF-8 byte offsets: convert through the line's bytes
    def pos(lineno: int, col: int) -> int:
        line = source[lines[lineno - 1] : lines[lineno]]
        return lines[lineno - 1] + len(line.encode()[:col].decode(errors="ignore"))

    return pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined,arg-type]


def candidates(path: str, source: str) -> list[Mutation]:
    """Every mutation of the file, in source order (deterministic)."""
    tree = ast.parse(source)
    lines = _offsets(source)
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
    }
    out: list[Mutation] = []

    def add(kind: str, node: ast.AST, new: ast.AST) -> None:
        start, end = _segment(source, lines, node)
        before = source[start:end]
        after = ast.unparse(new)
        if "\n" in before or after == before:  # keep to one-line, real changes
            return
        out.append(Mutation(path, kind, node.lineno, before, after, start, end))  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
            add("flip_compare", node, ast.Compare(node.left, [_FLIP[type(node.ops[0])]()], node.comparators))
        elif (
            isinstance(node, ast.Constant)
            and type(node.value) is int
            and abs(node.value) <= 64
            and id(node) not in docstrings
        ):
            add("off_by_one", node, ast.Constant(node.value + (1 if node.value <= 0 else -1)))
        elif isinstance(node, ast.If) and not isinstance(node.test, ast.Constant):
            add("remove_branch", node.test, ast.Constant(False))
        elif (
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and not any(isinstance(a, ast.Starred) for a in node.args[:2])
        ):
            if ast.dump(node.args[0]) != ast.dump(node.args[1]):
                add(
                    "swap_args",
                    node,
                    ast.Call(node.func, [node.args[1], node.args[0], *node.args[2:]], node.keywords),
                )
    out.sort(key=lambda m: (m.start, m.kind))
    return out


def sample(path: str, source: str, rng: random.Random, k: int) -> list[Mutation]:
    """Up to k distinct mutations of the file, drawn with `rng`."""
    cands = candidates(path, source)
    return rng.sample(cands, min(k, len(cands)))
