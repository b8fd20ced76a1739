"""The mutation check's own operators (scripts/mutation.py runs them beside cosmic-ray's): the bugs
people write that cosmic-ray's operators never make.

- constant-replacement: an attribute, a name or a call's result replaced by a constant its place
  allows: `True` / `False` as a condition (an `if`, `while`, `assert`-free test, a term of and/or,
  the operand of `not`, a conditional expression's test), `0` compared with an order or added
  (`<`, `+`, an augmented assignment, an index), `None` compared by `is`, `[]` iterated (a `for`, a
  comprehension, the argument of `len`, `sum`, `zip`, ...) or searched by `in`, `None` returned.
- boolean-term-drop: one operand of an `and` / `or` dropped.
- statement-deletion: an assignment, a call made for its effect, a `continue` / `break` / `return`
  turned into `pass`.
- argument-swap: two neighbouring positional arguments of a call swapped where they look the same
  type: both names, both attributes, or both numbers, and not the same text.
- off-by-one-index: `x[i]` to `x[i + 1]` / `x[i - 1]`, a slice bound +- 1 (not where the index or
  bound is a number: cosmic-ray's NumberReplacer makes those).

Each mutant is a token-precise edit of the source (the replaced expression's or statement's own
characters), so its diff is the one statement's lines. Only code in function bodies is mutated (a
statement at import changes what every test sees); left out: docstrings, assertions (internal
invariants: their conditions and messages), logging and warnings, f-strings, `__repr__`, type
annotations, default arguments and decorators. A mutant whose tree equals the original's, or that
another operator already made, is dropped.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

FAMILIES = {  # operator name prefix -> family, for scripts/mutation.py's per-family scores
    "ConstantReplacement": "constant-replacement", "BooleanTermDrop": "boolean-term-drop",
    "StatementDeletion": "statement-deletion", "ArgumentSwap": "argument-swap", "OffByOneIndex": "off-by-one-index",
}
ITERATING_CALLS = {"sum", "zip", "enumerate", "sorted", "reversed", "list", "set", "tuple", "any", "all",
                   "dict", "frozenset"}
SYMMETRIC_CALLS = {"min", "max"}   # swapping their two arguments changes nothing
QUIET_CALLS = {"print", "log", "debug", "info", "warning", "warn", "error", "exception", "critical"}
ORDERED = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Div, ast.Mod)
# expressions that bind as tightly as `+` or tighter: `e + 1` needs no parentheses around e
TIGHT = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)


@dataclass
class Edit:
    """One mutant: characters [start, end) of the source (as (line, column) pairs, lines from 1,
    columns in characters) replaced by `text`."""
    operator: str
    start: tuple[int, int]
    end: tuple[int, int]
    text: str


def mutants(source: str) -> list[tuple[int, str, str, str]]:
    """(first changed line, operator, mutated source, diff) for each of the operators' mutants, in
    file order; the diff has the changed lines only, '-' then '+' (what the harness's apply_diff and
    equivalent.json read)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    _LINES[:] = lines
    functions = _functions(tree)          # an edit changes one function's body: compare that function
    original = [ast.dump(f) for f in functions]
    seen: set[str] = set()
    out = []
    for edit in sorted(_Collector(lines).collect(tree), key=lambda e: (e.start, e.end, e.operator)):
        mutated, first, last, new_lines = _apply(lines, edit)
        try:
            changed = _functions(ast.parse(mutated))
        except SyntaxError:
            continue
        inner = max(i for i, f in enumerate(functions) if f.lineno <= first <= f.end_lineno)
        if ast.dump(changed[inner]) == original[inner] or mutated in seen:
            continue
        seen.add(mutated)
        diff = "\n".join([*(f"-{ln.rstrip(chr(10))}" for ln in lines[first - 1:last]),
                          *(f"+{ln.rstrip(chr(10))}" for ln in new_lines)])
        out.append((first, edit.operator, mutated, diff))
    return out


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions in source order (the last one holding a line is the innermost)."""
    return sorted((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                  key=lambda f: (f.lineno, f.col_offset))


def family(operator: str) -> str | None:
    return next((f for prefix, f in FAMILIES.items() if operator.startswith(prefix)), None)


def _apply(lines: list[str], edit: Edit) -> tuple[str, int, int, list[str]]:
    (l1, c1), (l2, c2) = edit.start, edit.end
    head, tail = lines[l1 - 1][:c1], lines[l2 - 1][c2:]
    new = (head + edit.text + tail).splitlines(keepends=True)
    return "".join(lines[:l1 - 1] + new + lines[l2:]), l1, l2, new


def _segment(lines: list[str], node: ast.AST) -> str:
    (l1, c1), (l2, c2) = _start(node), _end(node)
    if l1 == l2:
        return lines[l1 - 1][c1:c2]
    return lines[l1 - 1][c1:] + "".join(lines[l1:l2 - 1]) + lines[l2 - 1][:c2]


# ast's columns are UTF-8 byte offsets; the edits work in characters (the lines of the source being
# mutated: set by mutants(), one source at a time)
_LINES: list[str] = []


def _column(line: int, offset: int) -> int:
    return len(_LINES[line - 1].encode()[:offset].decode())


def _start(node: ast.AST) -> tuple[int, int]:
    return node.lineno, _column(node.lineno, node.col_offset)


def _end(node: ast.AST) -> tuple[int, int]:
    return node.end_lineno, _column(node.end_lineno, node.end_col_offset)


def _first_bindings(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[ast.Name]:
    """The Name nodes that bind a local for the first time in the function's text (its arguments
    bind theirs before any)."""
    bound = {a.arg for a in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs,
                             function.args.vararg, function.args.kwarg] if a is not None}
    stores = sorted((n for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)),
                    key=lambda n: (n.lineno, n.col_offset))
    first = set()
    for name in stores:
        if name.id not in bound:
            bound.add(name.id)
            first.add(name)
    return first


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return None


def _is_quiet(node: ast.AST) -> bool:
    """A call that only reports: print, logging, warnings."""
    if not isinstance(node, ast.Call):
        return False
    name = _call_name(node)
    base = node.func.value if isinstance(node.func, ast.Attribute) else None
    base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
    return name in QUIET_CALLS and (name == "print" or "log" in base_name or base_name == "warnings")


class _Collector:
    def __init__(self, lines: list[str]):
        self.lines = lines
        self.edits: list[Edit] = []

    def collect(self, tree: ast.Module) -> list[Edit]:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "__repr__":
                self.function = node
                self.first_bindings = _first_bindings(node)
                self.body(node.body, top=True)
        # a nested function is walked as its own function: keep each edit once
        unique = {(e.operator, e.start, e.end, e.text): e for e in self.edits}
        return list(unique.values())

    # ---- statements
    def body(self, stmts: list[ast.stmt], top: bool = False) -> None:
        for i, stmt in enumerate(stmts):
            if top and i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                    and isinstance(stmt.value.value, str):
                continue                                                    # the docstring
            self.statement(stmt)

    def statement(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assert, ast.Raise,
                             ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.Pass)):
            return                      # a nested def is visited as a function of its own
        if isinstance(stmt, ast.Expr) and (_is_quiet(stmt.value) or isinstance(stmt.value, ast.Constant)):
            return
        deletable = (isinstance(stmt, (ast.AugAssign, ast.Continue, ast.Break, ast.Return))
                     or (isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None
                         and self.reassigns(stmt))
                     or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, (ast.Call, ast.Await))))
        if deletable:
            kind = {ast.Assign: "Assign", ast.AugAssign: "Assign", ast.AnnAssign: "Assign", ast.Expr: "Call",
                    ast.Continue: "Continue", ast.Break: "Break", ast.Return: "Return"}[type(stmt)]
            self.edits.append(Edit(f"StatementDeletion_{kind}", _start(stmt), _end(stmt), "pass"))
        if isinstance(stmt, (ast.If, ast.While)):
            self.expression(stmt.test, "condition")
            self.body(stmt.body)
            self.body(stmt.orelse)
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            self.expression(stmt.target, "target")
            self.expression(stmt.iter, "iterated")
            self.body(stmt.body)
            self.body(stmt.orelse)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                self.expression(item.context_expr, "value")
            self.body(stmt.body)
        elif isinstance(stmt, ast.Try):
            self.body(stmt.body)
            for handler in stmt.handlers:
                self.body(handler.body)
            self.body(stmt.orelse)
            self.body(stmt.finalbody)
        elif isinstance(stmt, ast.Match):
            self.expression(stmt.subject, "value")
            for case in stmt.cases:
                self.body(case.body)
        elif isinstance(stmt, ast.Return):
            if stmt.value is not None:
                self.expression(stmt.value, "returned")
        elif isinstance(stmt, ast.AugAssign):
            self.expression(stmt.target, "target")
            self.expression(stmt.value, "added" if isinstance(stmt.op, ARITHMETIC) else "value")
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                self.expression(target, "target")
            self.expression(stmt.value, "value")
        elif isinstance(stmt, ast.AnnAssign):       # the annotation is not code that runs
            self.expression(stmt.target, "target")
            if stmt.value is not None:
                self.expression(stmt.value, "value")
        elif isinstance(stmt, ast.Expr):
            self.expression(stmt.value, "value")
        elif isinstance(stmt, ast.Delete):
            pass

    def reassigns(self, stmt: ast.Assign | ast.AnnAssign) -> bool:
        """Whether deleting the assignment leaves a program that runs: not a local's first binding
        (its next read would raise NameError), nor an attribute set in `__init__` (AttributeError)."""
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        for target in targets:
            for node in ast.walk(target):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node in self.first_bindings:
                    return False
            if self.function.name == "__init__" and isinstance(target, ast.Attribute):
                return False
        return True

    # ---- expressions: `place` is what the expression's position asks of its value
    def expression(self, node: ast.expr, place: str) -> None:
        if isinstance(node, (ast.Name, ast.Attribute, ast.Call)) and place != "target":
            self.constant(node, place)
        if isinstance(node, ast.JoinedStr) or _is_quiet(node) or isinstance(node, ast.Lambda):
            return
        if isinstance(node, ast.BoolOp):
            self.drop_terms(node)
            for value in node.values:  # a term of a value (`x or default`) may be of any type
                self.expression(value, "condition" if place == "condition" else "value")
        elif isinstance(node, ast.UnaryOp):
            self.expression(node.operand, "condition" if isinstance(node.op, ast.Not) else
                            "added" if isinstance(node.op, ast.USub) else "value")
        elif isinstance(node, ast.BinOp):
            inner = "added" if isinstance(node.op, ARITHMETIC) else "value"
            self.expression(node.left, inner)
            self.expression(node.right, inner)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, operand in enumerate(operands):
                ops = [op for j, op in enumerate(node.ops) if j in (i - 1, i)]
                if any(isinstance(op, (ast.Is, ast.IsNot)) for op in ops):
                    operand_place = "identity"
                elif i > 0 and isinstance(node.ops[i - 1], (ast.In, ast.NotIn)):
                    operand_place = "container"
                elif all(isinstance(op, ORDERED) for op in ops):
                    operand_place = "added"
                else:
                    operand_place = "value"
                self.expression(operand, operand_place)
        elif isinstance(node, ast.IfExp):
            self.expression(node.test, "condition")
            self.expression(node.body, place)
            self.expression(node.orelse, place)
        elif isinstance(node, ast.Call):
            self.expression(node.func, "function")
            self.swap_arguments(node)
            iterating = _call_name(node) in ITERATING_CALLS and isinstance(node.func, ast.Name)
            for arg in node.args:
                self.expression(arg.value if isinstance(arg, ast.Starred) else arg,
                                "iterated" if iterating else "value")
            for keyword in node.keywords:
                self.expression(keyword.value, "value")
        elif isinstance(node, ast.Attribute):
            self.expression(node.value, "base")
        elif isinstance(node, ast.Subscript):
            self.expression(node.value, "base")
            self.off_by_one(node)
            if isinstance(node.slice, ast.Slice):
                for bound in (node.slice.lower, node.slice.upper, node.slice.step):
                    if bound is not None:
                        self.expression(bound, "added")
            else:
                self.expression(node.slice, "added" if not isinstance(node.slice, (ast.Constant, ast.Tuple))
                                else "value")
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for generator in node.generators:
                self.expression(generator.iter, "iterated")
                for condition in generator.ifs:
                    self.expression(condition, "condition")
            for part in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
                self.expression(part, "value")
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            for element in node.elts:
                self.expression(element.value if isinstance(element, ast.Starred) else element, "value")
        elif isinstance(node, ast.Dict):
            for part in [*node.keys, *node.values]:
                if part is not None:
                    self.expression(part, "value")
        elif isinstance(node, (ast.NamedExpr, ast.Await)):
            self.expression(node.value, "value")

    # ---- the operators
    def constant(self, node: ast.expr, place: str) -> None:
        constants = {"condition": ["True", "False"], "added": ["0"],
                     "identity": ["None"], "iterated": ["[]"], "container": ["[]"], "returned": ["None"]}.get(place)
        if not constants or (isinstance(node, ast.Name) and node.id in ("self", "cls")):
            return
        kind = {ast.Name: "Name", ast.Attribute: "Attribute", ast.Call: "Call"}[type(node)]
        for text in constants:
            name = {"True": "True", "False": "False", "0": "Zero", "None": "None", "[]": "EmptyList"}[text]
            self.edits.append(Edit(f"ConstantReplacement_{kind}_{name}", _start(node), _end(node), text))

    def drop_terms(self, node: ast.BoolOp) -> None:
        joiner = " and " if isinstance(node.op, ast.And) else " or "
        for i in range(len(node.values)):
            kept = [self._operand(v) for j, v in enumerate(node.values) if j != i]
            self.edits.append(Edit(f"BooleanTermDrop_{'And' if joiner == ' and ' else 'Or'}", _start(node), _end(node),
                                   joiner.join(kept)))

    def _operand(self, node: ast.expr) -> str:
        text = _segment(self.lines, node)
        if isinstance(node, (ast.BoolOp, ast.IfExp, ast.NamedExpr, ast.Lambda)) and not text.startswith("("):
            return f"({text})"
        return text

    def swap_arguments(self, node: ast.Call) -> None:
        args = node.args if _call_name(node) not in SYMMETRIC_CALLS else []
        for a, b in zip(args, args[1:]):
            if isinstance(a, ast.Starred) or isinstance(b, ast.Starred):
                continue
            alike = (type(a) is type(b) and isinstance(a, (ast.Name, ast.Attribute))) or all(
                isinstance(x, ast.Constant) and type(x.value) in (int, float) for x in (a, b))
            text_a, text_b = _segment(self.lines, a), _segment(self.lines, b)
            if not alike or text_a == text_b:
                continue
            between = self._between(a, b)
            self.edits.append(Edit("ArgumentSwap", _start(a), _end(b), text_b + between + text_a))

    def _between(self, a: ast.expr, b: ast.expr) -> str:
        (l1, c1), (l2, c2) = _end(a), _start(b)
        if l1 == l2:
            return self.lines[l1 - 1][c1:c2]
        return self.lines[l1 - 1][c1:] + "".join(self.lines[l1:l2 - 1]) + self.lines[l2 - 1][:c2]

    def off_by_one(self, node: ast.Subscript) -> None:
        if isinstance(node.slice, ast.Slice):
            bounds = [b for b in (node.slice.lower, node.slice.upper) if b is not None]
        else:
            bounds = [node.slice]
        for bound in bounds:
            if isinstance(bound, (ast.Constant, ast.Tuple, ast.Slice, ast.JoinedStr)) or (
                    isinstance(bound, ast.UnaryOp) and isinstance(bound.operand, ast.Constant)):
                continue
            text = _segment(self.lines, bound)
            tight = isinstance(bound, TIGHT) or (isinstance(bound, ast.BinOp) and isinstance(bound.op, ARITHMETIC))
            text = text if tight else f"({text})"
            for delta in (" + 1", " - 1"):
                self.edits.append(Edit("OffByOneIndex_" + ("Plus" if "+" in delta else "Minus"),
                                       _start(bound), _end(bound), text + delta))
