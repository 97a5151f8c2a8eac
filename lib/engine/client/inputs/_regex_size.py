"""How many optional items one regex of a constraint holds, counted without compiling it.

Why: llguidance builds each lexeme (a regex, a Lark terminal with the terminals it names
inlined) by derivatives, and a sequence of *optional* items (`a?`, `x*`) grows every
derivative with it: the build takes time quadratic in their number (measured on llguidance
1.9, SmolLM2's vocabulary: 1,000 `a?` 19 ms, 8,000 in 2.3 s, 16,000 in 5-7 s, inside the
256 KiB size budget), before llguidance gives up with "lexer precomputation failed". The
other operators stay cheap at 8,000 (`a+`: 18 ms; 8,000 alternatives: 32 ms; `{0,8000}` and
`(a?){8000}`: 1 ms), so only `?` and `*` are counted. llguidance refuses about 700 of them
anyway, so the default limit (1,000) refuses nothing it would compile: it only bounds the
time it spends finding that out.
"""

from __future__ import annotations

from ._depth import _defines, _lark_tokens, closing_brackets

MAX_REGEX_OPTIONALS = 1000  # the default limit per regex


def regex_optionals(regex: str) -> int:
    """The `?` and `*` quantifiers in `regex` (escapes, character classes, group flags `(?`
    and lazy `*?`, `??`, `+?` not counted)."""
    count, at, after_quantifier = 0, 0, False
    while at < len(regex):
        char = regex[at]
        if char == "\\":
            at += 2
            after_quantifier = False
            continue
        if char == "[":
            at = _class_end(regex, at)
            after_quantifier = False
            continue
        if char in "?*" and not after_quantifier and not (at > 0 and regex[at - 1] == "("):
            count += 1
            after_quantifier = True
        else:
            after_quantifier = char in "+}"
        at += 1
    return count


def _class_end(regex: str, at: int) -> int:
    """Just past the character class that opens at `at` (`[]...]` and `[^]...]` hold `]`)."""
    at += 1
    if at < len(regex) and regex[at] == "^":
        at += 1
    if at < len(regex) and regex[at] == "]":
        at += 1
    while at < len(regex) and regex[at] != "]":
        at += 2 if regex[at] == "\\" else 1
    return at + 1


def lark_regex_optionals(grammar: str, limit: int) -> int:
    """The most optional items in one lexeme of a Lark grammar: a `/regex/` in a rule, or a
    terminal with every terminal it names inlined (counted as often as it is named, so a
    terminal of 100 terminals of 100 `"a"?` counts 10,000). Stops counting past `limit`."""
    tokens, _ = _lark_tokens(grammar)
    close = closing_brackets(tokens)
    own: dict[str, int] = {}  # terminal -> its optionals, not counting those it names
    names: dict[str, list[str]] = {}  # terminal -> the terminals it names
    most, current = 0, ""
    for i, (kind, text) in enumerate(tokens):
        if kind == "name" and _defines(tokens, close, i):
            current = text.lstrip("!?") if text.lstrip("_")[:1].isupper() else ""
            if current:
                own.setdefault(current, 0)
                names.setdefault(current, [])
        elif kind == "directive":
            current = ""
        elif kind == "regex":
            optionals = regex_optionals(text[1 : text.rindex("/")])
            if current:
                own[current] += optionals
            most = max(most, optionals)
        elif current and kind == "other" and text in "?*":
            own[current] += 1
        elif current and kind == "name":
            names[current].append(text)
    return max(most, _inlined_max(own, names, limit))


def _inlined_max(own: dict[str, int], names: dict[str, list[str]], limit: int) -> int:
    """The largest terminal once inlined, each sum stopped at `limit + 1` (a terminal of 100
    terminals of 100 ... grows exponentially). Iterative; a cycle (which llguidance refuses:
    terminals cannot recurse) counts its members once."""
    total: dict[str, int] = {}
    for root in own:
        work, entered = [root], {root}
        while work:
            name = work[-1]
            pending = [n for n in names[name] if n in own and n not in total and n not in entered]
            if pending:
                work += pending
                entered.update(pending)
                continue
            total[name] = min(limit + 1, own[name] + sum(total.get(n, 0) for n in names[name]))
            work.pop()
    return max(total.values(), default=0)


def schema_regex_optionals(schema: object) -> int:
    """The most optional items in one `pattern` (or `patternProperties` key) of a JSON
    schema, walked without recursion."""
    most, work = 0, [schema]
    while work:
        value = work.pop()
        if isinstance(value, list):
            work += value
        elif isinstance(value, dict):
            if isinstance(pattern := value.get("pattern"), str):
                most = max(most, regex_optionals(pattern))
            if isinstance(keyed := value.get("patternProperties"), dict):
                most = max((most, *(regex_optionals(k) for k in keyed if isinstance(k, str))))
            work += value.values()
    return most
