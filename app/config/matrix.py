"""llama-swap's matrix set expressions, parsed and expanded into model sets.

An entry of `routing.router.settings.matrix.sets` is an expression over model
names (or `vars` naming them):

    expr := term ("|" term)*      one of the alternatives
    term := atom ("&" atom)*      all of them together
    atom := NAME | "+" SET | "(" expr ")"

`&` binds tighter than `|`; a NAME is letters, digits, `_`, `-` and `.` (a
model id with other characters is named through `vars`); `+SET` stands for the
expression of another entry. `a & (b | c)` expands to the model sets {a, b}
and {a, c}, in that order.

Sets come out in llama-swap's order, which breaks the solver's ties: entries in
definition order, except that an entry referenced with `+` comes before the
entries that use it. Every problem names the entry and, inside an expression,
the 1-based position and what was expected there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, NoReturn

MAX_EXPANDED: Final = 4096
"""Model sets one entry may expand to: more is a typo or needs splitting."""
_PUNCT: Final = "&|()"


class ExpressionError(Exception):
    def __init__(self, message: str, position: int | None = None) -> None:
        self.message = message
        self.position = position  # 1-based, None when it concerns the whole expression
        super().__init__(f"at position {position}: {message}" if position else message)


@dataclass(frozen=True)
class Name:
    name: str
    position: int


@dataclass(frozen=True)
class Ref:
    name: str
    position: int


@dataclass(frozen=True)
class All:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class AnyOf:
    items: tuple[Node, ...]


Node = Name | Ref | All | AnyOf


def is_name_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_-."


@dataclass(frozen=True)
class _Token:
    kind: str  # "name", "ref", one of _PUNCT, or "end"
    text: str
    position: int  # 1-based


def _tokens(text: str) -> list[_Token]:
    out: list[_Token] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in _PUNCT:
            out.append(_Token(ch, ch, i + 1))
            i += 1
        elif ch == "+" or is_name_char(ch):
            start = i + 1 if ch == "+" else i
            end = start
            while end < len(text) and is_name_char(text[end]):
                end += 1
            if ch == "+" and end == start:
                raise ExpressionError("expected a set name after `+`", start + 1)
            out.append(_Token("ref" if ch == "+" else "name", text[start:end], i + 1))
            i = end
        else:
            raise ExpressionError(
                f"unexpected character {ch!r}; expected a name (letters, digits, `_`, `-`, `.`; "
                "name other model ids through `vars`), `+set`, `&`, `|`, `(` or `)`",
                i + 1,
            )
    out.append(_Token("end", "", len(text) + 1))
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.at = 0

    def peek(self) -> _Token:
        return self.tokens[self.at]

    def take(self) -> _Token:
        token = self.tokens[self.at]
        if token.kind != "end":
            self.at += 1
        return token

    def alternatives(self) -> Node:
        items = [self.together()]
        while self.peek().kind == "|":
            self.take()
            items.append(self.together())
        return items[0] if len(items) == 1 else AnyOf(tuple(items))

    def together(self) -> Node:
        items = [self.atom()]
        while self.peek().kind == "&":
            self.take()
            items.append(self.atom())
        return items[0] if len(items) == 1 else All(tuple(items))

    def atom(self) -> Node:
        token = self.take()
        if token.kind == "name":
            return Name(token.text, token.position)
        if token.kind == "ref":
            return Ref(token.text, token.position)
        if token.kind == "(":
            inner = self.alternatives()
            close = self.take()
            if close.kind != ")":
                raise ExpressionError(
                    f"expected `)` to close the `(` at position {token.position}, "
                    f"got {_shown(close)}",
                    close.position,
                )
            return inner
        raise ExpressionError(
            f"expected a model or var name, `+set` or `(`, got {_shown(token)}", token.position
        )


def _shown(token: _Token) -> str:
    return "the end of the expression" if token.kind == "end" else f"`{token.text}`"


def parse(text: str) -> Node:
    """The expression's tree; ExpressionError names the position and what was expected."""
    if not text.strip():
        raise ExpressionError("empty expression; expected model names joined by `&` and `|`")
    parser = _Parser(text)
    root = parser.alternatives()
    rest = parser.peek()
    if rest.kind != "end":
        raise ExpressionError(
            f"expected `&`, `|` or the end of the expression, got {_shown(rest)}", rest.position
        )
    return root


@dataclass(frozen=True)
class SetProblem:
    set_name: str
    message: str


@dataclass(frozen=True)
class ExpandedSets:
    sets: tuple[tuple[str, tuple[frozenset[str], ...]], ...]
    """(entry name, its model sets), in tie-break order."""
    problems: tuple[SetProblem, ...]


def expand_sets(
    definitions: Mapping[str, str],
    resolve: Callable[[str], str | None],
    suggest: Callable[[str], str] = lambda name: "",
) -> ExpandedSets:
    """Parse every entry, resolve its names with `resolve` (a var or a model id to
    the model id, None when unknown) and expand it. With any problem, `sets` is
    empty and `problems` lists every one found. `suggest(name)` may add a hint
    to an unknown name's message."""
    problems: list[SetProblem] = []
    roots: dict[str, Node] = {}
    for set_name, text in definitions.items():
        try:
            root = parse(text)
        except ExpressionError as exc:
            problems.append(SetProblem(set_name, str(exc)))
            continue
        for message in _check_names(root, definitions, resolve, suggest):
            problems.append(SetProblem(set_name, message))
        roots[set_name] = root
    if problems:
        return ExpandedSets((), tuple(problems))
    order, cycle = _dependency_order(roots)
    if cycle is not None:
        path = " -> ".join(f"`+{name}`" for name in cycle)
        return ExpandedSets(
            (), (SetProblem(cycle[0], f"sets refer to each other in a cycle: {path}"),)
        )
    expanded: dict[str, tuple[frozenset[str], ...]] = {}
    for set_name in order:
        try:
            expanded[set_name] = _expand(roots[set_name], expanded, resolve)
        except ExpressionError as exc:
            problems.append(SetProblem(set_name, str(exc)))
    if problems:
        return ExpandedSets((), tuple(problems))
    return ExpandedSets(tuple((name, expanded[name]) for name in order), ())


def _walk(node: Node) -> list[Name | Ref]:
    if isinstance(node, Name | Ref):
        return [node]
    return [leaf for item in node.items for leaf in _walk(item)]


def _check_names(
    root: Node,
    definitions: Mapping[str, str],
    resolve: Callable[[str], str | None],
    suggest: Callable[[str], str],
) -> list[str]:
    messages: list[str] = []
    for leaf in _walk(root):
        if isinstance(leaf, Ref):
            if leaf.name not in definitions:
                messages.append(f"at position {leaf.position}: `+{leaf.name}` names no set")
        elif resolve(leaf.name) is None:
            messages.append(
                f"at position {leaf.position}: unknown var or model {leaf.name!r}"
                f"{suggest(leaf.name)}"
            )
    return messages


def _refs(node: Node) -> list[str]:
    return list(dict.fromkeys(leaf.name for leaf in _walk(node) if isinstance(leaf, Ref)))


def _dependency_order(roots: Mapping[str, Node]) -> tuple[list[str], list[str] | None]:
    """Definition order, each entry after the entries it references; or a cycle."""
    done: set[str] = set()
    order: list[str] = []

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in done:
            return None
        if name in path:
            return [*path[path.index(name) :], name]
        path.append(name)
        for dependency in _refs(roots[name]):
            cycle = visit(dependency, path)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(name)
        order.append(name)
        return None

    for name in roots:
        cycle = visit(name, [])
        if cycle is not None:
            return order, cycle
    return order, None


def _expand(
    node: Node,
    expanded: Mapping[str, tuple[frozenset[str], ...]],
    resolve: Callable[[str], str | None],
) -> tuple[frozenset[str], ...]:
    if isinstance(node, Name):
        model = resolve(node.name)
        assert model is not None  # checked before expanding
        return (frozenset((model,)),)
    if isinstance(node, Ref):
        return expanded[node.name]
    parts = [_expand(item, expanded, resolve) for item in node.items]
    if isinstance(node, AnyOf):
        return _unique(s for part in parts for s in part)
    combined: tuple[frozenset[str], ...] = (frozenset(),)
    for part in parts:
        if len(combined) * len(part) > MAX_EXPANDED * 16:
            _too_many()
        combined = _unique(left | right for left in combined for right in part)
    return combined


def _unique(sets: Iterable[frozenset[str]]) -> tuple[frozenset[str], ...]:
    out = tuple(dict.fromkeys(sets))
    if len(out) > MAX_EXPANDED:
        _too_many()
    return out


def _too_many() -> NoReturn:
    raise ExpressionError(
        f"expands to more than {MAX_EXPANDED} model sets; split it into several entries"
    )
