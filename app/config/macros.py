"""`${...}` macro expansion and `cmd` splitting for config strings.

llama-swap compatible: user macros, `${env.NAME}`, and the per-model builtins
`${MODEL_ID}` and `${PORT}`. A macro may use only the macros defined before it
(llama-swap substitutes them last to first, so a later one is left literal and
refused); a model's own macros come after the global ones, and one that
overrides a global macro takes that macro's place.
A `cmd` is split like a shell splits words but never run through a shell, so
`$HOME`, pipes and globs are passed through literally.
"""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Mapping
from typing import Final

from app.config.checks import Issues, join_path

MacroValue = str | int | float | bool

REF: Final = re.compile(r"\$\{([^{}]*)\}")
# llama-swap refuses names of 64 characters or more.
NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,63}$")
# PID is filled in by the runtime when it runs cmdStop, so it is never a user macro.
RESERVED: Final = frozenset({"PORT", "MODEL_ID", "PID"})


class MacroError(Exception):
    """Problems found while expanding one string.

    Each problem is (location, message); location is None when the problem is in
    the string itself, else the config path of the macro whose value holds it,
    so a broken global macro is reported once however many models use it.
    """

    def __init__(self, problems: list[tuple[str | None, str]]) -> None:
        super().__init__("; ".join(message for _, message in problems))
        self.problems = problems


def format_value(value: MacroValue) -> str:
    """Text of a macro value; booleans as YAML writes them, not Python's True."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class Expander:
    """Expands `${...}` references against one table of macros.

    `builtins` are per-model values (`MODEL_ID`, `PORT`); names in `keep` stay
    verbatim for a later pass (`PORT` before ports are assigned, `PID` for the
    runtime). `origins` maps each macro name to where it was defined.
    """

    def __init__(
        self,
        macros: Mapping[str, MacroValue],
        *,
        environ: Mapping[str, str],
        origins: Mapping[str, str],
        builtins: Mapping[str, MacroValue] | None = None,
        keep: frozenset[str] = frozenset(),
    ) -> None:
        self._macros = macros
        self._environ = environ
        self._origins = origins
        self._builtins = builtins or {}
        self._keep = keep
        self._resolved: dict[str, MacroValue] = {}
        self._order = {name: i for i, name in enumerate(macros)}

    def expand(self, text: str) -> str:
        problems: list[tuple[str | None, str]] = []
        result = self._expand(text, (), problems)
        if problems:
            raise MacroError(problems)
        return result

    def expand_typed(self, text: str) -> MacroValue:
        """Like expand, but a string that is exactly one reference keeps the
        macro's type, so `port: ${PORT}` in metadata stays an integer."""
        whole = REF.fullmatch(text)
        if whole is None or whole.group(1) in self._keep:
            return self.expand(text)
        problems: list[tuple[str | None, str]] = []
        value = self._lookup(whole.group(1), (), problems)
        if problems or value is None:
            raise MacroError(problems)
        return value

    def _expand(
        self, text: str, stack: tuple[str, ...], problems: list[tuple[str | None, str]]
    ) -> str:
        def substitute(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in self._keep:
                return match.group(0)
            value = self._lookup(name, stack, problems)
            return match.group(0) if value is None else format_value(value)

        return REF.sub(substitute, text)

    def _lookup(
        self, name: str, stack: tuple[str, ...], problems: list[tuple[str | None, str]]
    ) -> MacroValue | None:
        where = self._origins.get(stack[-1]) if stack else None
        if name.startswith("env."):
            var = name[4:]
            if var in self._environ:
                text = self._environ[var]
                if any(c in text for c in "\n\r\x00"):
                    # llama-swap pastes env values into the YAML text, so it refuses these.
                    problems.append(
                        (where, f"environment variable {var} contains a newline or a null byte")
                    )
                    return None
                return text
            problems.append((where, f"environment variable {var} is not set (used as ${{{name}}})"))
            return None
        if name in self._builtins:
            return self._builtins[name]
        if name not in self._macros:
            problems.append((where, self._unknown(name)))
            return None
        if stack and self._order[name] >= self._order[stack[-1]]:
            message = (
                "uses itself"
                if name == stack[-1]
                else f"uses ${{{name}}}, which is defined after it; a macro may use only "
                "the macros defined before it"
            )
            problems.append((where, message))
            return None
        if name in self._resolved:
            return self._resolved[name]
        # Only earlier macros may be used, so a macro can never reach itself again.
        raw = self._macros[name]
        if not isinstance(raw, str):
            self._resolved[name] = raw
            return raw
        before = len(problems)
        whole = REF.fullmatch(raw)
        value: MacroValue | None
        if whole is not None and whole.group(1) not in self._keep:
            value = self._lookup(whole.group(1), (*stack, name), problems)
        else:
            value = self._expand(raw, (*stack, name), problems)
        if len(problems) > before or value is None:
            return None
        self._resolved[name] = value
        return value

    def _unknown(self, name: str) -> str:
        if name == "PID":
            return "${PID} is only available in cmdStop"
        if name == "PORT" or name == "MODEL_ID":
            return f"${{{name}}} is only available in model settings"
        known = [*self._macros, *self._builtins, *self._keep]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean ${{{close[0]}}}?" if close else ""
        return f"unknown macro ${{{name}}}{hint}"


def expand(issues: Issues, expander: Expander, text: str, where: str) -> str | None:
    """`text` expanded, or None with each problem reported where it lies."""
    try:
        return expander.expand(text)
    except MacroError as exc:
        for location, message in exc.problems:
            issues.error(location or where, message)
        return None


def check_macro_names(issues: Issues, macros: Mapping[str, MacroValue], path: str) -> None:
    for name in macros:
        where = join_path(path, name)
        if name in RESERVED:
            issues.error(where, f"{name} is a reserved macro name")
        elif not NAME.match(name):
            issues.error(where, "macro names are 1-63 characters of letters, digits, _ and -")


def strip_comments(text: str) -> str:
    """Drop `#` comments and join `\\`-continued lines of a multi-line `cmd`.

    A `#` starts a comment only at the start of a word and outside quotes, as in
    a shell, so `--color=#fff` and `'a # b'` survive. shlex's own comment
    handling would cut `foo#bar`, hence this scanner. Other newlines are left in
    place: shlex treats them as whitespace, which is what llama-swap does.
    """
    out: list[str] = []
    i, n = 0, len(text)
    quote: str | None = None
    while i < n:
        char = text[i]
        if quote == "'":
            out.append(char)
            if char == "'":
                quote = None
            i += 1
        elif char == "\\":
            if i + 1 < n and text[i + 1] == "\n":
                i += 2  # continuation: backslash-newline vanishes, as in a shell
            else:
                out.append(text[i : i + 2])
                i += 2
        elif quote == '"':
            out.append(char)
            if char == '"':
                quote = None
            i += 1
        elif char in "'\"":
            quote = char
            out.append(char)
            i += 1
        elif char == "#" and (not out or out[-1][-1:].isspace()):
            while i < n and text[i] != "\n":
                i += 1
        else:
            out.append(char)
            i += 1
    return "".join(out)


def split_args(text: str) -> list[str]:
    """Split an expanded command line into argv; ValueError on unbalanced quotes."""
    return shlex.split(text, comments=False, posix=True)
