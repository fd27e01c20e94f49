"""`helm template` for the tests, in Python: no registry here ships a helm binary for this Python.

It interprets the chart's own Go templates (the subset the chart uses: if / else if / range /
with / define / include, variables, pipelines and the functions in `FUNCS`) with Helm's
values merge and whitespace rules. An unknown function or an unsupported construct raises, so
what renders here renders under Helm; a missing map key is nil, as in Go.
Cross-checked against Helm v4's own engine (libhelm, from the helm-sdkpy wheel, which needs
Python >= 3.12 and so is no dependency here): `helm lint` clean and the same objects, field for
field, for every values case in test_chart.py.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml


class TemplateError(Exception):
    """The chart does not render: a template error, a `fail` or a `required` value."""


# ---- lexing -------------------------------------------------------------------------------

ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<raw>`[^`]*`)
    | (?P<num>-?\d+(?:\.\d+)?)
    | (?P<decl>:=)
    | (?P<punct>[()|,=])
    | (?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)
    | (?P<field>(?:\.[A-Za-z0-9_]+)+|\.)
    | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.X,
)


def tokens(src: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    src = src.strip()
    while pos < len(src):
        m = TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"cannot parse {src[pos:]!r} in {{{{ {src} }}}}")
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


# ---- parsing ------------------------------------------------------------------------------


@dataclass
class Node:
    kind: str  # text | out | if | range | with | define | set
    text: str = ""
    expr: list[tuple[str, str]] = field(default_factory=list)
    body: list[Node] = field(default_factory=list)
    # if: [(cond, body), ...] and else body; range/with: else body
    branches: list[tuple[list[tuple[str, str]], list[Node]]] = field(default_factory=list)
    orelse: list[Node] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # range's / set's variables
    declare: bool = True


def split(src: str) -> Iterator[tuple[str, str]]:
    """Text and actions, with `{{-` / `-}}` trimming applied to the text beside them."""
    pos, trim_next = 0, False
    for m in ACTION.finditer(src):
        text = src[pos : m.start()]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if m.group(1):
            text = text.rstrip(" \t\r\n")
        if text:
            yield "text", text
        body = m.group(2).strip()
        if not (body.startswith("/*") and body.endswith("*/")):
            yield "action", body
        pos, trim_next = m.end(), bool(m.group(3))
    text = src[pos:]
    if trim_next:
        text = text.lstrip(" \t\r\n")
    if text:
        yield "text", text


def parse(src: str, defines: dict[str, list[Node]]) -> list[Node]:
    items = list(split(src))
    nodes, i = _parse_block(items, 0, defines, top=True)
    assert i == len(items)
    return nodes


def _parse_block(
    items: list[tuple[str, str]], i: int, defines: dict[str, list[Node]], top: bool = False
) -> tuple[list[Node], int]:
    out: list[Node] = []
    while i < len(items):
        kind, body = items[i]
        if kind == "text":
            out.append(Node("text", text=body))
            i += 1
            continue
        word = body.split(None, 1)[0] if body else ""
        rest = body[len(word) :].strip()
        if word in ("end", "else"):
            if top:
                raise TemplateError(f"unexpected {{{{ {body} }}}}")
            return out, i
        if word == "if":
            node = Node("if", branches=[(tokens(rest), [])])
            i = _parse_branches(items, i + 1, defines, node)
        elif word in ("range", "with"):
            node = Node(word)
            toks = tokens(rest)
            if any(k == "decl" for k, _ in toks):
                at = next(n for n, (k, _) in enumerate(toks) if k == "decl")
                node.names = [v for k, v in toks[:at] if k == "var"]
                toks = toks[at + 1 :]
            node.expr = toks
            node.body, i = _parse_block(items, i + 1, defines)
            if items[i][1] == "else":
                node.orelse, i = _parse_block(items, i + 1, defines)
            i = _expect_end(items, i)
        elif word == "define":
            name = json.loads(rest)
            defines[name], i = _parse_block(items, i + 1, defines)
            i = _expect_end(items, i)
            continue
        else:
            toks = tokens(body)
            if (
                len(toks) > 2
                and toks[0][0] == "var"
                and toks[1] in (("decl", ":="), ("punct", "="))
            ):
                node = Node("set", names=[toks[0][1]], expr=toks[2:], declare=toks[1][0] == "decl")
            else:
                node = Node("out", expr=toks)
            i += 1
        out.append(node)
    if not top:
        raise TemplateError("missing {{ end }}")
    return out, i


def _parse_branches(
    items: list[tuple[str, str]], i: int, defines: dict[str, list[Node]], node: Node
) -> int:
    while True:
        body, i = _parse_block(items, i, defines)
        node.branches[-1] = (node.branches[-1][0], body)
        head = items[i][1]
        if head.startswith("else if "):
            node.branches.append((tokens(head[len("else if ") :]), []))
            i += 1
            continue
        if head == "else":
            node.orelse, i = _parse_block(items, i + 1, defines)
        return _expect_end(items, i)


def _expect_end(items: list[tuple[str, str]], i: int) -> int:
    if i >= len(items) or items[i][1] != "end":
        raise TemplateError("missing {{ end }}")
    return i + 1


# ---- values and functions -----------------------------------------------------------------


def truthy(v: Any) -> bool:
    return v is not None and v is not False and v != 0 and v != "" and v != [] and v != {}


def gostr(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        raise TemplateError(f"printing a {type(v).__name__} as text: {v!r}")
    return str(v)


def gofmt(fmt: str, *args: Any) -> str:
    vals = iter(args)

    def one(m: re.Match[str]) -> str:
        verb = m.group(1)
        if verb == "%":
            return "%"
        v = next(vals)
        return json.dumps(gostr(v)) if verb == "q" else str(int(v)) if verb == "d" else gostr(v)

    return re.sub(r"%([sdqv%])", one, fmt)


def to_yaml(v: Any) -> str:
    if v is None:
        return "null"
    return yaml.safe_dump(v, sort_keys=True, default_flow_style=False).rstrip("\n")


def indent(n: int, s: str) -> str:
    pad = " " * n
    return pad + s.replace("\n", "\n" + pad)


def required(msg: str, v: Any) -> Any:
    if v is None or v == "":
        raise TemplateError(msg)
    return v


def fail(msg: str) -> Any:
    raise TemplateError(msg)


def default(d: Any, *v: Any) -> Any:
    return v[0] if v and truthy(v[0]) else d


FUNCS: dict[str, Callable[..., Any]] = {
    "toYaml": to_yaml,
    "toJson": lambda v: json.dumps(v, separators=(",", ":"), sort_keys=True),
    "quote": lambda *v: " ".join(json.dumps(gostr(x)) for x in v if x is not None),
    "indent": indent,
    "nindent": lambda n, s: "\n" + indent(n, s),
    "default": default,
    "required": required,
    "fail": fail,
    "printf": gofmt,
    "print": lambda *v: "".join(gostr(x) for x in v),
    "eq": lambda a, *b: any(a == x for x in b),
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "gt": lambda a, b: a > b,
    "not": lambda v: not truthy(v),
    "and": lambda *v: next((x for x in v if not truthy(x)), v[-1]),
    "or": lambda *v: next((x for x in v if truthy(x)), v[-1]),
    "empty": lambda v: not truthy(v),
    "list": lambda *v: list(v),
    "dict": lambda *v: {gostr(v[i]): v[i + 1] for i in range(0, len(v), 2)},
    "append": lambda seq, v: [*seq, v],
    "join": lambda sep, seq: sep.join(gostr(x) for x in seq),
    "trunc": lambda n, s: s[:n],
    "trimSuffix": lambda suf, s: s[: -len(suf)] if suf and s.endswith(suf) else s,
    "contains": lambda sub, s: sub in s,
    "hasKey": lambda d, k: k in d,
    "regexMatch": lambda pattern, s: re.search(pattern, s) is not None,
    "b64enc": lambda s: base64.b64encode(gostr(s).encode()).decode(),
    "toString": gostr,
    "int": int,
    "add": lambda *v: sum(int(x) for x in v),
    "max": lambda *v: max(int(x) for x in v),
}


# ---- evaluation ---------------------------------------------------------------------------


class Renderer:
    def __init__(self, defines: dict[str, list[Node]], root: dict[str, Any]) -> None:
        self.defines = defines
        self.root = root

    def run(self, nodes: list[Node], dot: Any, scopes: list[dict[str, Any]]) -> str:
        out: list[str] = []
        for node in nodes:
            out.append(self.node(node, dot, scopes))
        return "".join(out)

    def node(self, node: Node, dot: Any, scopes: list[dict[str, Any]]) -> str:
        if node.kind == "text":
            return node.text
        if node.kind == "out":
            return gostr(self.pipeline(node.expr, dot, scopes))
        if node.kind == "set":
            value = self.pipeline(node.expr, dot, scopes)
            if node.declare:
                scopes[-1][node.names[0]] = value
            else:
                for scope in reversed(scopes):
                    if node.names[0] in scope:
                        scope[node.names[0]] = value
                        break
                else:
                    raise TemplateError(f"undefined variable {node.names[0]}")
            return ""
        if node.kind == "if":
            for cond, body in node.branches:
                if truthy(self.pipeline(cond, dot, scopes)):
                    return self.run(body, dot, [*scopes, {}])
            return self.run(node.orelse, dot, [*scopes, {}])
        value = self.pipeline(node.expr, dot, scopes)
        if node.kind == "with":
            if truthy(value):
                return self.run(node.body, value, [*scopes, {}])
            return self.run(node.orelse, dot, [*scopes, {}])
        assert node.kind == "range"
        if not truthy(value):
            return self.run(node.orelse, dot, [*scopes, {}])
        pairs = sorted(value.items()) if isinstance(value, dict) else list(enumerate(value))
        out = []
        for key, item in pairs:
            scope: dict[str, Any] = {}
            if len(node.names) == 1:
                scope[node.names[0]] = item
            elif len(node.names) == 2:
                scope[node.names[0]], scope[node.names[1]] = key, item
            out.append(self.run(node.body, item, [*scopes, scope]))
        return "".join(out)

    def pipeline(self, toks: list[tuple[str, str]], dot: Any, scopes: list[dict[str, Any]]) -> Any:
        commands: list[list[tuple[str, str]]] = [[]]
        depth = 0
        for tok in toks:
            if tok == ("punct", "|") and depth == 0:
                commands.append([])
                continue
            depth += tok == ("punct", "(")
            depth -= tok == ("punct", ")")
            commands[-1].append(tok)
        value: Any = _NOTHING
        for command in commands:
            value = self.command(command, dot, scopes, value)
        return value

    def command(
        self, toks: list[tuple[str, str]], dot: Any, scopes: list[dict[str, Any]], piped: Any
    ) -> Any:
        args, i = [], 0
        while i < len(toks):
            kind, text = toks[i]
            if (kind, text) == ("punct", "("):
                depth, j = 1, i + 1
                while depth:
                    depth += toks[j] == ("punct", "(")
                    depth -= toks[j] == ("punct", ")")
                    j += 1
                args.append(("value", self.pipeline(toks[i + 1 : j - 1], dot, scopes)))
                i = j
                continue
            args.append((kind, text))
            i += 1
        head_kind, head = args[0]
        if head_kind == "ident" and head not in ("true", "false", "nil"):
            values = [self.operand(k, t, dot, scopes) for k, t in args[1:]]
            if piped is not _NOTHING:
                values.append(piped)
            if head == "include":
                return self.include(values[0], values[1])
            if head not in FUNCS:
                raise TemplateError(f"function {head!r} is not supported")
            return FUNCS[head](*values)
        if len(args) != 1 or piped is not _NOTHING:
            raise TemplateError(f"{head!r} is not a function")
        return self.operand(head_kind, head, dot, scopes)

    def operand(self, kind: str, text: str, dot: Any, scopes: list[dict[str, Any]]) -> Any:
        if kind == "value":
            return text
        if kind == "str":
            return json.loads(text)
        if kind == "raw":
            return text[1:-1]
        if kind == "num":
            return float(text) if "." in text else int(text)
        if kind == "ident":
            return {"true": True, "false": False, "nil": None}[text]
        if kind == "field":
            return walk(dot, text.split(".")[1:] if text != "." else [])
        if kind == "var":
            name, *path = text.split(".")
            if name == "$":
                return walk(self.root, path)
            for scope in reversed(scopes):
                if name in scope:
                    return walk(scope[name], path)
            raise TemplateError(f"undefined variable {name}")
        raise TemplateError(f"unexpected {text!r}")

    def include(self, name: str, dot: Any) -> str:
        if name not in self.defines:
            raise TemplateError(f"no template {name!r}")
        # `$` inside a template is the data it was called with
        return Renderer(self.defines, dot).run(self.defines[name], dot, [{}])


_NOTHING = object()


def walk(value: Any, path: list[str]) -> Any:
    """Go's field chain on maps: a missing key is nil; a field of nil (or of a string) fails."""
    for i, key in enumerate(path):
        if not isinstance(value, dict):
            raise TemplateError(f"nil pointer evaluating {'.'.join(path[: i + 1])!r}")
        value = value.get(key)
    return value


# ---- the chart ----------------------------------------------------------------------------


def merge(base: Any, over: Any) -> Any:
    """Helm's values merge: maps merge key by key, anything else replaces; null deletes."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge(base.get(k), v)
        return out
    return over


@dataclass
class Rendered:
    manifests: list[dict[str, Any]]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        [doc] = [m for m in self.of_kind(kind) if m["metadata"]["name"] == name]
        return doc


def template(
    chart: Path,
    values: dict[str, Any] | None = None,
    release: str = "tokenyard",
    namespace: str = "default",
) -> Rendered:
    """`helm template RELEASE CHART --namespace NAMESPACE -f values` → the parsed manifests."""
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    merged = merge(yaml.safe_load((chart / "values.yaml").read_text()), values or {})
    schema = chart / "values.schema.json"
    if schema.exists():  # as Helm does before rendering
        jsonschema.validate(merged, json.loads(schema.read_text()))
    defines: dict[str, list[Node]] = {}
    files = sorted((chart / "templates").iterdir())
    parsed = {f.name: parse(f.read_text(), defines) for f in files}
    root = {
        "Values": merged,
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
        "Chart": {
            "Name": meta["name"],
            "Version": meta["version"],
            "AppVersion": meta.get("appVersion", ""),
        },
    }
    manifests: list[dict[str, Any]] = []
    notes = ""
    for name, nodes in parsed.items():
        scope_root = {**root, "Template": {"Name": f"{meta['name']}/templates/{name}"}}
        text = Renderer(defines, scope_root).run(nodes, scope_root, [{}])
        if name == "NOTES.txt":
            notes = text
        elif not name.startswith("_"):
            manifests.extend(d for d in yaml.safe_load_all(text) if d)
    return Rendered(manifests, notes)
