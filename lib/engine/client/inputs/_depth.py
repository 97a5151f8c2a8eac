"""How deep a JSON schema or a Lark grammar goes, measured without recursion.

Both become a graph whose nodes are what llguidance recurses through (a JSON object; a rule
or terminal) and whose edges are what it follows (nesting and `$ref`s; the names a rule's
body uses). The depth is the heaviest path, a cycle counted once at its members' sum: a
recursive rule or schema is compiled once per member, but one path may pass through all of
them before it closes. Loops, not recursion, everywhere: the input is the attacker's.

The resolution is deliberately loose where llguidance might be more precise (a `$ref` may
match several candidates; a name defined twice merges): a graph with an edge too many can
only measure deeper, never shallower, than the compiler recurses.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from urllib.parse import unquote, urldefrag, urljoin

REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
ANCHOR_KEYS = ("$anchor", "$dynamicAnchor")


def heaviest_path(weights: list[int], edges: list[list[int]]) -> int:
    """The weight of the heaviest path, each strongly connected component counted once at
    the sum of its nodes' weights (Tarjan, iterative: components come out successors first,
    so each one's best successor is known when it is closed)."""
    n = len(weights)
    index, low, component = [-1] * n, [0] * n, [-1] * n
    on_stack = [False] * n
    stack: list[int] = []
    best: list[int] = []  # per component: the heaviest path that starts in it
    counter = 0
    for root in range(n):
        if index[root] != -1:
            continue
        work = [(root, 0)]
        while work:
            v, i = work[-1]
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            if i < len(edges[v]):
                work[-1] = (v, i + 1)
                w = edges[v][i]
                if index[w] == -1:
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] != index[v]:
                continue
            c, members = len(best), []
            while True:
                w = stack.pop()
                on_stack[w] = False
                component[w] = c
                members.append(w)
                if w == v:
                    break
            after = max(
                (best[component[w]] for m in members for w in edges[m] if component[w] != c),
                default=0,
            )
            best.append(sum(weights[m] for m in members) + after)
    return max(best, default=0)


# -- JSON schemas ----------------------------------------------------------------------------


def schema_depth(schema: object) -> int:
    """The JSON objects on the deepest path through `schema`, each `$ref` (`$dynamicRef`,
    `$recursiveRef`) followed into the object it names: by JSON pointer, `$id` or anchor."""
    node_of: dict[int, int] = {}  # id(JSON object) -> node
    edges: list[list[int]] = []
    resources: dict[str, object] = {"": schema}  # base URI -> its root
    anchors: dict[str, list[object]] = defaultdict(list)
    refs: list[tuple[int, str, str]] = []  # (node, reference, base URI)
    work: list[tuple[object, int, str]] = [(schema, -1, "")]
    while work:
        value, parent, base = work.pop()
        if isinstance(value, list):
            work += [(item, parent, base) for item in value if isinstance(item, dict | list)]
            continue
        if not isinstance(value, dict):
            continue
        node = node_of[id(value)] = len(edges)
        edges.append([])
        if parent >= 0:
            edges[parent].append(node)
        if "$id" in value and isinstance(own := value["$id"], str):
            uri, fragment = urldefrag(urljoin(base, own))
            if uri:
                resources[uri] = resources.get(uri, value)
                base = uri
            if fragment and not fragment.startswith("/"):
                anchors[fragment].append(value)
        for key in ANCHOR_KEYS:
            if key in value and isinstance(name := value[key], str):
                anchors[name].append(value)
        for key in REF_KEYS:
            if key in value and isinstance(ref := value[key], str):
                refs.append((node, ref, base))
        work += [(child, node, base) for child in value.values() if isinstance(child, dict | list)]
    for node, ref, base in refs:
        for target in _targets(ref, base, resources, anchors):
            if (to := node_of.get(id(target))) is not None:
                edges[node].append(to)
    return heaviest_path([1] * len(edges), edges)


def _targets(
    ref: str, base: str, resources: dict[str, object], anchors: dict[str, list[object]]
) -> list[object]:
    """Every object `ref` may name, read from `base`."""
    uri, fragment = ("", ref[1:]) if ref.startswith("#") else urldefrag(ref)
    if uri:
        keys = {uri, urljoin(base, uri)}
        roots = [resources[k] for k in keys if k in resources]
    else:  # within the current resource (or, loosely, the document)
        roots = [resources[k] for k in {base, ""} if k in resources]
    if fragment and not fragment.startswith("/"):
        return list(anchors.get(unquote(fragment), ()))
    found = []
    for root in roots:
        target = _pointer(root, fragment) if fragment else root
        if target is not None:
            found.append(target)
    return found


def _pointer(root: object, pointer: str) -> object | None:
    """The value at JSON pointer `pointer` ("/$defs/a") in `root`, or None."""
    value = root
    for token in pointer[1:].split("/"):
        key = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return value


# -- Lark grammars ---------------------------------------------------------------------------

# llguidance's Lark lexemes (parser/src/lark/lexer.rs), longest first where two could start
# alike: the same names as it reads them ("myRule" is the two names "my" and "Rule").
_LARK = re.compile(
    r"""
    (?P<skip>[ \t\r\n]+|(?:\#|//)[^\n]*)
    | (?P<string>"(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})|[^"\\\x00-\x1f\x7f])*"i?)
    | (?P<regex>/(?:\\.|[^/\\])+/[imslux]*)
    | (?P<directive>%[a-z]+)
    | (?P<special><[^<>\s]+>)
    | (?P<grammar>@[a-zA-Z0-9_\-]+)
    | (?P<name>!?[_?]?[a-z][_a-z0-9\-]*|_?[A-Z][_A-Z0-9]*)
    | (?P<number>[+-]?[0-9]+)
    | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)
_JSON_DIRECTIVES = ("%json", "%regex", "%llguidance")  # each followed by a JSON value


def lark_depth(grammar: str) -> int:
    """The deepest chain of references in a Lark grammar (llguidance's dialect): its rules
    and terminals, each inline ``%json`` schema a node as deep as the schema."""
    tokens, schemas = _lark_tokens(grammar)
    close = closing_brackets(tokens)
    weights: list[int] = []
    uses: list[list[str]] = []
    edges: list[list[int]] = []
    defined: dict[str, int] = {}
    current = -1  # the definition (or statement) whose body is being read
    for i, (kind, text) in enumerate(tokens):
        if kind == "name" and _defines(tokens, close, i):
            name = text.lstrip("!?")
            if name not in defined:  # defined twice: one node (looser, never shallower)
                defined[name] = len(weights)
                weights.append(1)
                uses.append([])
                edges.append([])
            current = defined[name]
        elif kind == "directive" and text not in _JSON_DIRECTIVES:  # %ignore, %import ...
            current = len(weights)
            weights.append(0)
            uses.append([])
            edges.append([])
        elif current < 0:
            continue
        elif kind == "name":
            uses[current].append(text.lstrip("!?"))
        elif kind == "json":
            edges[current].append(len(weights))
            weights.append(schemas[int(text)])
            uses.append([])
            edges.append([])
    for node, names in enumerate(uses):
        edges[node] += [defined[name] for name in names if name in defined]
    return heaviest_path(weights, edges)


def closing_brackets(tokens: list[tuple[str, str]]) -> list[int]:
    """close[i]: the index of the first "]" at or after token i (len(tokens) if none), so
    `_defines` skips a definition's `[attributes]` in one step."""
    close = [len(tokens)] * (len(tokens) + 1)
    for i in range(len(tokens) - 1, -1, -1):
        close[i] = i if tokens[i] == ("other", "]") else close[i + 1]
    return close


def _defines(tokens: list[tuple[str, str]], close: list[int], i: int) -> bool:
    """Whether the name at `i` starts a definition: `name`, then `.PRIORITY` or
    `[attributes]` (in either order), then `:`."""
    j = i + 1
    while j < len(tokens):
        if tokens[j] == ("other", ".") and j + 1 < len(tokens) and tokens[j + 1][0] == "number":
            j += 2
        elif tokens[j] == ("other", "["):
            j = close[j] + 1
        else:
            return tokens[j] == ("other", ":")
    return False


def _lark_tokens(grammar: str) -> tuple[list[tuple[str, str]], list[int]]:
    """The grammar's lexemes, blanks and comments dropped; a ``%json`` value becomes one
    ("json", index) lexeme, its schema's depth at `schemas[index]`."""
    tokens: list[tuple[str, str]] = []
    schemas: list[int] = []
    at = 0
    while at < len(grammar):
        match = _LARK.match(grammar, at)
        assert match is not None and match.lastgroup is not None  # `other` takes any char
        kind, at = match.lastgroup, match.end()
        if kind == "skip":
            continue
        tokens.append((kind, match.group()))
        if kind == "directive" and match.group() in _JSON_DIRECTIVES:
            start = _skip_blanks(grammar, at)
            end = _json_end(grammar, start)
            if end > start:
                if match.group() == "%json":
                    tokens.append(("json", str(len(schemas))))
                    schemas.append(_inline_schema_depth(grammar[start:end]))
                at = end
    return tokens, schemas


def _skip_blanks(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _json_end(text: str, start: int) -> int:
    """Where the JSON object or array that starts at `start` ends (`start` if none does)."""
    if start >= len(text) or text[start] not in "{[":
        return start
    depth, at, in_string = 0, start, False
    while at < len(text):
        char = text[at]
        if in_string:
            if char == "\\":
                at += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return at + 1
        at += 1
    return start


# GBNF (llama.cpp's, as llguidance's converter reads it): names of word characters and "-".
_GBNF = re.compile(
    r"""
    (?P<skip>\s+|\#[^\n]*)
    | (?P<string>"(?:\\.|[^"\\])*")
    | (?P<class>\[(?:\\.|[^\]\\])*\])
    | (?P<defines>::=)
    | (?P<name>[\w-]+)
    | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)


def gbnf_depth(grammar: str) -> int:
    """The deepest chain of rule references in a GBNF grammar, measured before its conversion
    to Lark: the converter takes time quadratic in a chain's length (2,000 rules: 6 s)."""
    names = [m.group() for m in _GBNF.finditer(grammar) if m.lastgroup in ("name", "defines")]
    defined: dict[str, int] = {}
    for i in range(len(names) - 1):
        if names[i + 1] == "::=" and names[i] != "::=":
            defined.setdefault(names[i], len(defined))
    edges: list[list[int]] = [[] for _ in defined]
    current = -1
    for i, name in enumerate(names):
        if i + 1 < len(names) and names[i + 1] == "::=" and name != "::=":
            current = defined[name]
        elif current >= 0 and name in defined:
            edges[current].append(defined[name])
    return heaviest_path([1] * len(defined), edges)


def _inline_schema_depth(text: str) -> int:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):  # llguidance refuses it too, without recursing
        return 1
    return schema_depth(schema)
