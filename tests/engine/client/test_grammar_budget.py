"""The depth and size budget of a request's constraint (`_grammar_budget`, `_depth`) and the
big-stack thread its check runs on (`_big_stack`): the red team's chains are refused with the
value and the limit, real schemas and grammars pass, and a raised budget still cannot crash
the process that checks.

Issue 25: a chain of 3,000 rules or `$ref`s (123-208 KB) overflowed llguidance's stack in the
API process (SIGSEGV). Here the same inputs run in the test process itself: were the check
not on its large stack, the raised-budget test would kill pytest (the probe beside it shows
that an 8 MiB thread does die).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import llguidance
import pytest
import trio

from trillm.cli import build_parser
from trillm.engine.client import (
    MAX_GRAMMAR_BYTES,
    MAX_REGEX_OPTIONALS,
    MAX_STRUCTURED_DEPTH,
    LLMConfig,
)
from trillm.engine.client.inputs._big_stack import run_sync_on_stack
from trillm.engine.client.inputs._depth import gbnf_depth, lark_depth, schema_depth
from trillm.engine.client.inputs._grammar_budget import GrammarBudget, GrammarBudgetError
from trillm.engine.client.inputs._regex_size import (
    lark_regex_optionals,
    regex_optionals,
    schema_regex_optionals,
)
from trillm.engine.client.inputs._structured import (
    GrammarChecker,
    StructuredOutputError,
    StructuredOutputs,
)
from trillm.engine.protocol import EngineConfig
from trillm.gpu import WorkerConfig
from trillm.http.turn._tools import auto_grammar, required_grammar

from ...http import test_structured_http as http_cases
from ...http import test_tools, test_tools_llama3
from . import test_structured_generation

ROOT = Path(__file__).resolve().parents[3]


def rule_chain(n: int) -> str:
    """The red team's grammar: `r0: "a" r1 | "b" r1 | "c"` ... `rN: "z"`, from `start`."""
    rules = [f'r{i}: "a" r{i + 1} | "b" r{i + 1} | "c"' for i in range(n)]
    return "\n".join(["start: r0", *rules, f'r{n}: "z"'])


def ref_chain(n: int) -> dict[str, Any]:
    """The red team's schema: `d_i = {"anyOf": [{"type": "integer"}, {"$ref": d_i+1}]}`."""
    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"type": "integer"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


# -- the limits, word for word ---------------------------------------------------------------


def test_the_flags_default_to_the_budgets_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.structured_outputs_max_depth == MAX_STRUCTURED_DEPTH == 512
    assert args.structured_outputs_max_bytes == MAX_GRAMMAR_BYTES == 256 * 1024
    assert args.structured_outputs_max_regex_optionals == MAX_REGEX_OPTIONALS == 1000
    assert GrammarBudget() == GrammarBudget(
        max_depth=512, max_bytes=262144, max_regex_optionals=1000
    )
    assert GrammarBudget().stack_bytes == 256 << 20


def test_a_chain_of_3000_rules_is_refused_naming_its_depth_and_the_limit() -> None:
    grammar = rule_chain(3000)
    assert 100_000 < len(grammar) < MAX_GRAMMAR_BYTES  # the red team's size: under the cap
    with pytest.raises(StructuredOutputError) as caught:
        StructuredOutputs(grammar=grammar).to_grammar()
    assert caught.value.field == "structured_outputs.grammar"
    assert str(caught.value) == (
        "the structured_outputs.grammar nests 3002 deep (rules on one chain of references, an "
        "inline %json adding its depth); the limit is 512 (--structured-outputs-max-depth)"
    )


def test_a_chain_of_3000_refs_is_refused_naming_its_depth_and_the_limit() -> None:
    schema = ref_chain(3000)
    assert 200_000 < len(json.dumps(schema)) < MAX_GRAMMAR_BYTES
    for given in (schema, json.dumps(schema)):  # an object, or its text
        with pytest.raises(StructuredOutputError) as caught:
            StructuredOutputs(json=given).to_grammar()
        assert caught.value.field == "structured_outputs.json"
        assert str(caught.value) == (
            "the structured_outputs.json nests 6003 deep (JSON objects on one path, each $ref "
            "followed); the limit is 512 (--structured-outputs-max-depth)"
        )


def test_100000_links_are_refused_by_the_size_budget_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(StructuredOutputError) as grammar:
        StructuredOutputs(grammar=rule_chain(100_000)).to_grammar()
    with pytest.raises(StructuredOutputError) as schema:
        StructuredOutputs(json=ref_chain(100_000)).to_grammar()
    assert time.monotonic() - started < 10  # building the inputs is most of it
    assert str(grammar.value) == (
        "the structured_outputs.grammar is 3766702 bytes; the limit is 262144 bytes "
        "(--structured-outputs-max-bytes)"
    )
    assert str(schema.value) == (
        "the structured_outputs.json is 7177850 bytes; the limit is 262144 bytes "
        "(--structured-outputs-max-bytes)"
    )


def test_100000_links_are_measured_exactly_without_recursion() -> None:
    """Past the size cap too: the measure is a loop, so no input deepens the caller's stack
    (Python's recursion limit, 1,000, stays untouched)."""
    budget = GrammarBudget(max_bytes=64 << 20)
    with pytest.raises(GrammarBudgetError, match=r"^nests 100002 deep ") as rules:
        budget.check_lark(rule_chain(100_000))
    with pytest.raises(GrammarBudgetError, match=r"^nests 200003 deep ") as refs:
        budget.check_schema(ref_chain(100_000))
    assert (rules.value.value, rules.value.limit) == (100_002, 512)
    assert (refs.value.value, refs.value.limit) == (200_003, 512)


def test_a_budget_out_of_range_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"^--structured-outputs-max-depth must be >= 1, got 0$"):
        GrammarBudget(max_depth=0)
    with pytest.raises(ValueError, match=r"^--structured-outputs-max-bytes must be >= 1, got -1$"):
        GrammarBudget(max_bytes=-1)
    engine = EngineConfig(worker=WorkerConfig("unused"))
    with pytest.raises(ValueError, match="--structured-outputs-max-depth must be >= 1"):
        LLMConfig(engine, structured_outputs_max_depth=0)
    assert LLMConfig(engine, structured_outputs_max_depth=7).grammar_budget.max_depth == 7


def test_a_schema_too_deep_for_python_to_parse_is_a_400() -> None:
    text = '{"anyOf": [' * 5000 + "{}" + "]}" * 5000
    with pytest.raises(StructuredOutputError, match=r"^the JSON schema nests too deep to parse"):
        StructuredOutputs(json=text).to_grammar()


# -- what is measured ------------------------------------------------------------------------


def chain_of(make: Any, n: int = 10, root: dict[str, Any] | None = None) -> dict[str, Any]:
    """`root` (its `$ref` into the chain) with `$defs` d0 ... dN: `make(i)` each, dN a leaf."""
    defs = {f"d{i}": make(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {**(root or {}), "$defs": defs}


@pytest.mark.parametrize(
    ("schema", "depth"),
    [
        ({"type": "integer"}, 1),
        ({"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}, 4),
        ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, 2),  # lists do not count
        # root, $defs, d0 ... d10 (each $ref to the next)
        (chain_of(lambda i: {"$ref": f"#/$defs/d{i + 1}"}, root={"$ref": "#/$defs/d0"}), 13),
        (  # old-style definitions, a pointer into properties, an escaped token
            {
                "definitions": {"a/b": {"$ref": "#/properties/x"}},
                "properties": {"x": {"items": {"type": "integer"}}},
                "$ref": "#/definitions/a~1b",
            },
            5,  # root, definitions, a/b, then x and its items
        ),
        (  # absolute $ids (urn:) and ids relative to a base
            chain_of(
                lambda i: {"$id": f"urn:d{i}", "anyOf": [{"$ref": f"urn:d{i + 1}"}]},
                root={"$ref": "urn:d0"},
            ),
            22,  # root, $defs, then d_i and the object in its anyOf, ten times, then d10
        ),
        (
            chain_of(
                lambda i: {"$id": f"d{i}.json", "items": {"$ref": f"d{i + 1}.json"}},
                root={"$id": "https://example.com/root.json", "$ref": "d0.json"},
            ),
            22,
        ),
        (  # anchors
            chain_of(
                lambda i: {"$anchor": f"a{i}", "not": {"$ref": f"#a{i + 1}"}},
                root={"$ref": "#a0"},
            ),
            22,
        ),
        ({"$ref": "#/$defs/missing", "$defs": {}}, 2),  # unresolved: no edge
    ],
    ids=[
        "leaf",
        "nested",
        "anyOf",
        "$defs",
        "pointers",
        "urn-ids",
        "relative-ids",
        "anchors",
        "unresolved",
    ],
)
def test_the_depth_follows_pointers_ids_and_anchors(schema: dict[str, Any], depth: int) -> None:
    assert schema_depth(schema) == depth


def test_a_recursive_schema_counts_its_cycle_once() -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
            }
        },
        "$ref": "#/$defs/node",
    }
    # root -> node -> properties -> children -> items -> node again (the cycle: 4 objects)
    assert schema_depth(tree) == 7
    ring = chain_of(lambda i: {"$ref": f"#/$defs/d{(i + 1) % 4}"}, 4, root={"$ref": "#/$defs/d0"})
    assert schema_depth(ring) == 1 + 1 + 4  # root, $defs, then the ring of 4 once


@pytest.mark.parametrize(
    ("grammar", "depth"),
    [
        ('start: "a" b\nb: "b"+', 2),
        ("start: a\na: b\nb: c\nc: /x/", 4),
        ('start: a\n// a: b c d\n# b: c\na: "b: c" /d: e/ B\nB: "b"', 3),  # comments, strings
        ("start: myRule\nmy: x\nRule: x\nx: /x/", 3),  # llguidance reads "my" "Rule"
        ('start: a\na.2: b\nb[lazy, stop="x"]: C\nC: "c"', 4),  # priority, attributes
        ("start: a\n%ignore WS\nWS: W\nW: V\nV: /[ ]+/\na: /a/", 3),  # %ignore's chain
        ('start: "x" %json {"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}}', 4),
        ('start: a\na: "(" a ")" | b\nb: /b/', 3),  # recursion: its cycle once
    ],
    ids=["tiny", "chain", "comments", "mixed-case", "attributes", "ignore", "%json", "cycle"],
)
def test_lark_depth_reads_llguidances_lexemes(grammar: str, depth: int) -> None:
    assert lark_depth(grammar) == depth


def test_a_gbnf_chain_is_refused_before_its_slow_conversion_to_lark() -> None:
    """llguidance's GBNF converter takes the square of a chain's length (3,000 rules: 11 s
    of Python holding the GIL), so GBNF is measured first, as itself."""
    gbnf = "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "c"\n' for i in range(3000))
    gbnf += 'r3000 ::= "z"\n'
    started = time.monotonic()
    with pytest.raises(StructuredOutputError) as caught:
        StructuredOutputs(grammar=gbnf).to_grammar()
    assert time.monotonic() - started < 2
    assert str(caught.value) == (
        "the structured_outputs.grammar nests 3002 deep (rules on one chain of references); "
        "the limit is 512 (--structured-outputs-max-depth)"
    )


@pytest.mark.parametrize(
    ("grammar", "depth"),
    [
        ('root ::= "x"', 1),
        ('root ::= a # b ::= c\na ::= "b ::= c" [b] b\nb ::= [a-z]', 3),  # comment, string
        ("root ::= (a | b)*\na ::= b\nb ::= root | [x]", 3),  # recursion: once
    ],
)
def test_gbnf_depth_reads_names_rules_and_references(grammar: str, depth: int) -> None:
    assert gbnf_depth(grammar) == depth


def test_a_tool_whose_parameters_chain_refs_is_refused_inside_its_grammar() -> None:
    """Tools reach the grammar as a Lark `%json` (`_tools.required_grammar`), their
    parameters nested in the call's schema: `$id`s resolve wherever they sit."""
    parameters = chain_of(
        lambda i: {"$id": f"urn:d{i}", "anyOf": [{"type": "null"}, {"$ref": f"urn:d{i + 1}"}]},
        2000,
        root={"$ref": "urn:d0"},
    )
    function = {"name": "f", "parameters": parameters}
    for grammar in (required_grammar([function], parallel=True), auto_grammar([function])):
        assert grammar is not None
        with pytest.raises(StructuredOutputError, match=r"nests 400\d deep \(rules on one chain"):
            StructuredOutputs(grammar=grammar).to_grammar()


# -- the corpus: every real schema and grammar passes -------------------------------------------

# Public schemas and grammars beside the repository's own: the JSON Schema draft-07 meta-schema
# (recursive through "#" from most of its properties), a recursive file tree, an order with
# nested refs, and llama.cpp's json.gbnf and arithmetic.gbnf.
DRAFT7 = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "$id": "http://json-schema.org/draft-07/schema#",
    "definitions": {
        "schemaArray": {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
        "nonNegativeInteger": {"type": "integer", "minimum": 0},
        "nonNegativeIntegerDefault0": {
            "allOf": [{"$ref": "#/definitions/nonNegativeInteger"}, {"default": 0}]
        },
        "simpleTypes": {
            "enum": ["array", "boolean", "integer", "null", "number", "object", "string"]
        },
        "stringArray": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    },
    "type": ["object", "boolean"],
    "properties": {
        "$id": {"type": "string", "format": "uri-reference"},
        "$ref": {"type": "string", "format": "uri-reference"},
        "title": {"type": "string"},
        "default": True,
        "multipleOf": {"type": "number", "exclusiveMinimum": 0},
        "maxLength": {"$ref": "#/definitions/nonNegativeInteger"},
        "minLength": {"$ref": "#/definitions/nonNegativeIntegerDefault0"},
        "additionalItems": {"$ref": "#"},
        "items": {"anyOf": [{"$ref": "#"}, {"$ref": "#/definitions/schemaArray"}]},
        "required": {"$ref": "#/definitions/stringArray"},
        "additionalProperties": {"$ref": "#"},
        "definitions": {"type": "object", "additionalProperties": {"$ref": "#"}},
        "properties": {"type": "object", "additionalProperties": {"$ref": "#"}},
        "dependencies": {
            "type": "object",
            "additionalProperties": {
                "anyOf": [{"$ref": "#"}, {"$ref": "#/definitions/stringArray"}]
            },
        },
        "propertyNames": {"$ref": "#"},
        "enum": {"type": "array", "items": True},
        "type": {
            "anyOf": [
                {"$ref": "#/definitions/simpleTypes"},
                {"type": "array", "items": {"$ref": "#/definitions/simpleTypes"}},
            ]
        },
        "if": {"$ref": "#"},
        "then": {"$ref": "#"},
        "else": {"$ref": "#"},
        "allOf": {"$ref": "#/definitions/schemaArray"},
        "anyOf": {"$ref": "#/definitions/schemaArray"},
        "oneOf": {"$ref": "#/definitions/schemaArray"},
        "not": {"$ref": "#"},
    },
}
FILE_TREE = {
    "$defs": {
        "entry": {
            "anyOf": [
                {"$ref": "#/$defs/file"},
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "entries": {"type": "array", "items": {"$ref": "#/$defs/entry"}},
                    },
                    "required": ["name", "entries"],
                },
            ]
        },
        "file": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
            "required": ["name", "size"],
        },
    },
    "$ref": "#/$defs/entry",
}
INVOICE = {
    "$defs": {
        "money": {
            "type": "object",
            "properties": {"amount": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}},
        },
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
        },
        "line": {
            "type": "object",
            "properties": {
                "sku": {"type": "string"},
                "price": {"$ref": "#/$defs/money"},
                "discounts": {"type": "array", "items": {"$ref": "#/$defs/money"}},
            },
        },
    },
    "type": "object",
    "properties": {
        "billing": {"$ref": "#/$defs/address"},
        "shipping": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
        "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}},
        "total": {"$ref": "#/$defs/money"},
    },
}
JSON_GBNF = r"""root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
"""
ARITHMETIC_GBNF = r"""root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
"""


def structured_bench() -> Any:
    """perf/structured_bench.py, whose compile set is the benchmark's corpus."""
    spec = importlib.util.spec_from_file_location(
        "structured_bench", ROOT / "perf/structured_bench.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def corpus() -> dict[str, StructuredOutputs]:
    """Every schema and grammar the tests and benchmarks send, and the public ones above."""
    bench = structured_bench()
    # distinct names (a oneOf of two get_time calls is no grammar llguidance takes)
    functions = [test_tools.WEATHER, test_tools_llama3.TIME, test_tools_llama3.NEWS]
    found = {f"bench: {name}": constraint for name, constraint in bench.compile_set().items()} | {
        "http: person": StructuredOutputs(json=http_cases.PERSON),
        "http: order": StructuredOutputs(json=http_cases.ORDER),
        "http: big schema": StructuredOutputs(json=http_cases.big_schema()),
        "generation: person": StructuredOutputs(json=test_structured_generation.PERSON),
        "bench: long": StructuredOutputs(json=bench.LONG),
        "http: tools (required)": StructuredOutputs(
            grammar=required_grammar([f.get("function", f) for f in functions], parallel=True)
        ),
        "http: tools (auto, strict)": StructuredOutputs(
            grammar=auto_grammar([f.get("function", f) for f in functions])
        ),
        "public: draft-07 meta-schema": StructuredOutputs(json=DRAFT7),
        "public: file tree": StructuredOutputs(json=FILE_TREE),
        "public: invoice": StructuredOutputs(json=INVOICE),
        "public: llama.cpp json.gbnf": StructuredOutputs(grammar=JSON_GBNF),
        "public: llama.cpp arithmetic.gbnf": StructuredOutputs(grammar=ARITHMETIC_GBNF),
    }
    return found


CORPUS = corpus()


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_every_schema_and_grammar_of_the_corpus_passes_the_default_budget(name: str) -> None:
    constraint = CORPUS[name]
    constraint.to_grammar()  # within the default budget, or it raises
    budget = GrammarBudget(max_depth=64)  # and far within: the default is 8x this
    if constraint.kind == "json":
        budget.check_schema(constraint.json)
    elif constraint.kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        budget.check_lark(any_to_lark(str(constraint.grammar)))


async def test_the_repositorys_corpus_also_passes_llguidances_check(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    checker = GrammarChecker(ll_tokenizer, timeout=30)
    for name, constraint in CORPUS.items():
        if not name.startswith("public: draft-07"):  # llguidance lacks some of its keywords
            await checker.check(constraint)


# -- optional items per regex: llguidance's lexer build is quadratic in them ------------------

OPTIONALS_LIMIT = (
    "has more than 1000 optional items (? or *) in one {what}, the limit "
    "(--structured-outputs-max-regex-optionals); use a counted repeat such as a{{0,N}} instead"
)


@pytest.mark.parametrize(
    ("regex", "count"),
    [
        ("a?", 1),
        ("a??", 1),  # lazy: one optional item
        ("a*?b*", 2),
        ("a+?", 0),
        ("a{2,3}?", 0),
        ("(?:ab)?", 1),  # the group flag is not a quantifier
        ("(?i)x", 0),
        (r"\?\*", 0),
        ("[?*]", 0),
        ("[]?*]", 0),
        ("[^]?]*", 1),
        (r"[\]?]x?", 1),
        ("(a|b)?" * 3, 3),
    ],
)
def test_regex_optionals_counts_quantifiers_not_literals(regex: str, count: int) -> None:
    assert regex_optionals(regex) == count


def test_16000_optional_items_are_refused_at_once_naming_the_limit() -> None:
    """The red team's regex: 32 KB, it passes every other budget, and llguidance's lexer takes
    5-7 s to give up on it (quadratic: 1,000 take 19 ms)."""
    started = time.monotonic()
    with pytest.raises(StructuredOutputError) as refused:
        StructuredOutputs(regex="a?" * 16_000).to_grammar()
    assert time.monotonic() - started < 1  # counted, not compiled: milliseconds
    assert str(refused.value) == "the structured_outputs.regex " + OPTIONALS_LIMIT.format(
        what="regex"
    )
    assert refused.value.field == "structured_outputs.regex"
    StructuredOutputs(regex="a?" * 1000).to_grammar()  # the limit itself passes
    StructuredOutputs(regex="a{0,16000}").to_grammar()  # the counted repeat: cheap, passes


def test_terminals_are_counted_inlined_as_often_as_they_are_named() -> None:
    nested = 'start: D\nB: "a"?\nC: ' + " ".join(["B"] * 100) + "\nD: " + " ".join(["C"] * 80)
    assert lark_regex_optionals(nested, limit=100_000) == 8000
    assert lark_regex_optionals(nested, limit=1000) == 1001  # stops counting past the limit
    # 2**40 once inlined: the count saturates instead of growing
    doubling = "start: T40\nT0: /a?/\n" + "".join(f"T{i + 1}: T{i} T{i}\n" for i in range(40))
    assert lark_regex_optionals(doubling, limit=1000) == 1001
    # separate lexemes are built apart: their counts do not add up
    apart = "start: " + " ".join(f"A{i}" for i in range(8)) + "\n"
    apart += "".join(f"A{i}: /" + "a?" * 900 + "/\n" for i in range(8))
    assert lark_regex_optionals(apart, limit=1000) == 900
    assert lark_regex_optionals("start: x /" + "b*" * 5 + "/ x?\nx: /c?/", limit=1000) == 5
    with pytest.raises(StructuredOutputError) as refused:
        StructuredOutputs(grammar=nested).to_grammar()
    assert str(refused.value) == "the structured_outputs.grammar " + OPTIONALS_LIMIT.format(
        what="regex or terminal"
    )
    gbnf = "root ::= " + " ".join(['"a"?'] * 3000)  # GBNF rules are Earley rules: cheap
    StructuredOutputs(grammar=gbnf).to_grammar()


def test_a_schemas_patterns_are_counted() -> None:
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^" + "[0-9]?" * 1001 + "$"}},
    }
    assert schema_regex_optionals(schema) == 1001
    assert schema_regex_optionals({"patternProperties": {"x?y*": {"pattern": "z?"}}}) == 2
    with pytest.raises(StructuredOutputError) as refused:
        StructuredOutputs(json=schema).to_grammar()
    assert str(refused.value) == "the structured_outputs.json " + OPTIONALS_LIMIT.format(
        what="pattern"
    )


async def test_what_llguidances_lexer_refuses_is_a_400_in_the_frontend(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    """900 `a?` pass the budget, but llguidance's lexer refuses them when it builds the
    matcher, which validation alone does not: the frontend builds it too, so that is a 400
    here, not a stream the engine ends in an error."""
    checker = GrammarChecker(ll_tokenizer, timeout=30)
    with pytest.raises(StructuredOutputError, match="lexer precomputation failed"):
        await checker.check(StructuredOutputs(regex="a?" * 900))
    assert await checker.check(StructuredOutputs(regex="a?" * 50))


# -- a raised budget: the check's own stack holds ----------------------------------------------


async def test_a_raised_budget_admits_3000_links_and_the_check_survives_them(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    """The red team's inputs through the frontend's whole check, in this process: on an 8 MiB
    thread (trio's) each is a SIGSEGV (the probe below); on the check's 256 MiB one, a grammar."""
    checker = GrammarChecker(ll_tokenizer, timeout=60, budget=GrammarBudget(max_depth=100_000))
    for constraint in (
        StructuredOutputs(grammar=rule_chain(3000)),
        StructuredOutputs(json=ref_chain(3000)),
    ):
        assert await checker.check(constraint)  # checked: valid for this tokenizer


PROBE = """
import sys, threading, llguidance
from tests.grammars import smollm2_ll_tokenizer
rules = [f'r{i}: "a" r{i + 1} | "b" r{i + 1} | "c"' for i in range(3000)]
grammar = llguidance.LLMatcher.grammar_from_lark("\\n".join(["start: r0", *rules, 'r3000: "z"']))
tokenizer = smollm2_ll_tokenizer()
threading.stack_size(int(sys.argv[1]))
thread = threading.Thread(target=llguidance.LLMatcher.validate_grammar, args=(grammar, tokenizer))
thread.start()
thread.join()
print("survived")
"""


@pytest.mark.parametrize(("stack", "survives"), [(8 << 20, False), (256 << 20, True)])
def test_the_same_check_on_a_default_stack_crashes_and_on_the_large_one_survives(
    stack: int, survives: bool
) -> None:
    """Both sides of what the large stack is for, in a process of its own."""
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(stack)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if survives:
        assert (probe.returncode, probe.stdout) == (0, "survived\n"), probe.stderr
    else:
        assert probe.returncode == -11, (probe.returncode, probe.stderr)  # SIGSEGV


# -- the big-stack thread ------------------------------------------------------------------------


async def test_run_sync_on_stack_returns_raises_and_leaves_the_default_stack_alone() -> None:
    limiter = trio.CapacityLimiter(1)
    before = threading.stack_size()
    assert await run_sync_on_stack(sum, [1, 2, 3], stack_bytes=64 << 20, limiter=limiter) == 6
    with pytest.raises(ZeroDivisionError):
        await run_sync_on_stack(lambda: 1 // 0, stack_bytes=64 << 20, limiter=limiter)
    assert threading.stack_size() == before  # set only while its own thread started
    assert limiter.borrowed_tokens == 0


async def test_a_cancelled_call_is_abandoned_and_gives_its_token_back_when_done() -> None:
    limiter = trio.CapacityLimiter(1)
    release = threading.Event()
    with trio.move_on_after(0.05) as scope:
        await run_sync_on_stack(release.wait, stack_bytes=64 << 20, limiter=limiter)
    assert scope.cancelled_caught
    assert limiter.borrowed_tokens == 1  # the thread still runs
    release.set()
    with trio.fail_after(10):
        async with limiter:  # given back once the abandoned thread ends
            pass
