"""The JSON schema of a forced tool call object (`{"name", "arguments"}`) over one or more tools.

Each tool's `parameters` becomes the `arguments` of one branch of an `anyOf`. A tool's schema may
refer into itself with local `$ref`s (`"#/$defs/Location"`, what Pydantic's `model_json_schema`
writes, `"#/definitions/..."`, or `"#"` for a recursive root): placed inside the merged schema, such a
pointer would resolve against the merged root, which has none of the tool's `$defs` (the compiler's
"cannot be compiled"). So every local `$ref` of tool i is rebased onto the branch that holds its schema
(`#/anyOf/i/properties/arguments` + the pointer): it names the same subschema as before, whatever it
pointed at, and two tools' `$defs` of the same name stay apart. Values that are data, not schemas
(`const`, `enum`, `default`, `examples`), are left as they are.
"""

from __future__ import annotations

DATA = frozenset({"const", "enum", "default", "examples"})    # keywords whose values are JSON data
NAMED = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})  # name -> schema


def call_schema(functions: list[dict]) -> dict:
    """The schema a forced call object must match: one `anyOf` branch per function (`{"name",
    "parameters"}`) with its name as a `const` and its parameters, local `$ref`s rebased, as `arguments`."""
    return {"anyOf": [{"type": "object", "required": ["name", "arguments"],
                       "properties": {"name": {"const": fn["name"]},
                                      "arguments": rebase(fn["parameters"], f"#/anyOf/{i}/properties/arguments")}}
                      for i, fn in enumerate(functions)]}


def rebase(schema, base: str):
    """`schema` with every local `$ref` ("#..." ) prefixed by `base` (a JSON pointer fragment naming where
    `schema` now sits); a copy, the input unchanged. Remote refs (not starting with "#") are kept."""
    if isinstance(schema, list):
        return [rebase(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in DATA:
            out[key] = value
        elif key in NAMED and isinstance(value, dict):       # names there are not keywords
            out[key] = {name: rebase(sub, base) for name, sub in value.items()}
        else:
            out[key] = rebase(value, base)
    return out
