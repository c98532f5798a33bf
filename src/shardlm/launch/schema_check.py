"""The generated specs checked against their owners' published schemas, vendored in
launch/schemas/ (its README: versions, sources, what was trimmed): Kubeflow Trainer's CRDs
(TrainJob, ClusterTrainingRuntime) and SkyPilot's task YAML schema.

`schema_errors` is a JSON Schema check for the keywords those schemas use (type, required,
properties, patternProperties, additionalProperties, items, enum, anyOf, oneOf, not, the string,
number, array and object bounds; Kubernetes' x-kubernetes-preserve-unknown-fields; SkyPilot's
case_insensitive_enum and case_sensitive_enum); no jsonschema dependency. Format and CEL rules
(x-kubernetes-validations) are not checked: the vendored files leave them out."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

SCHEMAS = Path(__file__).parent / "schemas"
TRAINER_SCHEMAS = "kubeflow-trainer-v2.3.0.json"
SKYPILOT_SCHEMAS = "skypilot-0.14.1.json"
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


@functools.cache
def load(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text(encoding="utf-8"))


def trainer_errors(doc: dict) -> list[str]:
    """A Kubeflow Trainer document (TrainJob or ClusterTrainingRuntime) against its CRD's schema.
    Kubernetes schemas are structural: a field the schema does not name is unknown (the API server
    drops it, kubectl's strict field validation refuses it)."""
    schemas = load(TRAINER_SCHEMAS)
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind not in schemas:
        return [f"$.kind: {kind!r} is not one of {sorted(schemas)}"]
    return schema_errors(doc, schemas[kind], closed=True)


def skypilot_errors(task: dict) -> list[str]:
    """A SkyPilot task as `sky launch` checks it: the task schema, then `resources` against the
    resources schema and each bucket in `file_mounts` against the storage schema (SkyPilot
    validates those separately, as here). Top-level None values are dropped first, as SkyPilot does."""
    schemas = load(SKYPILOT_SCHEMAS)
    if not isinstance(task, dict):
        return [f"$: a task is a mapping, not {type(task).__name__}"]
    task = {k: v for k, v in task.items() if v is not None}
    out = schema_errors(task, schemas["task"])
    if isinstance(task.get("resources"), dict):
        out += schema_errors(task["resources"], schemas["resources"], "$.resources")
    for where, mount in (task.get("file_mounts") or {}).items():
        if isinstance(mount, dict):
            out += schema_errors(mount, schemas["storage"], f"$.file_mounts[{where!r}]")
    return out


def schema_errors(value, schema: dict, path: str = "$", closed: bool = False) -> list[str]:
    """Every way `value` breaks `schema`, each as 'PATH: what'. `closed`: an object's keys must
    be named by the schema unless it allows more (Kubernetes' structural schemas); otherwise JSON
    Schema's default, any key allowed unless additionalProperties says no."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is(value, t) for t in types):
            return [f"{path}: {type(value).__name__} {_short(value)}, expected {' or '.join(types)}"]
    out = _alternatives(value, schema, path, closed)
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {_short(value)} is not one of {schema['enum']}")
    for key, fold in (("case_insensitive_enum", str.lower), ("case_sensitive_enum", str)):
        if key in schema and isinstance(value, str) and fold(value) not in map(fold, schema[key]):
            out.append(f"{path}: {value!r} is not one of {schema[key]}")
    if isinstance(value, str):
        out += _bounds(path, len(value), schema, "minLength", "maxLength", "characters")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{path}: {value} > maximum {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            out.append(f"{path}: {value} <= exclusive minimum {schema['exclusiveMinimum']}")
    elif isinstance(value, list):
        out += _bounds(path, len(value), schema, "minItems", "maxItems", "items")
        if schema.get("uniqueItems") and len({json.dumps(v, sort_keys=True) for v in value}) < len(value):
            out.append(f"{path}: items are not unique")
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                out += schema_errors(item, schema["items"], f"{path}[{i}]", closed)
    elif isinstance(value, dict):
        out += _object_errors(value, schema, path, closed)
    return out


def _object_errors(value: dict, schema: dict, path: str, closed: bool) -> list[str]:
    out = [f"{path}: missing required field {k!r}" for k in schema.get("required", []) if k not in value]
    out += _bounds(path, len(value), schema, "minProperties", "maxProperties", "fields")
    props, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extra = schema.get("additionalProperties")
    open_ = (schema.get("x-kubernetes-preserve-unknown-fields") is True or extra is True
             or (extra is None and not closed))
    for key, item in value.items():
        named = key in props
        if named:
            out += schema_errors(item, props[key], f"{path}.{key}", closed)
        for pattern, sub in patterns.items():
            if re.search(pattern, key):
                named = True
                out += schema_errors(item, sub, f"{path}.{key}", closed)
        if named:
            continue
        if isinstance(extra, dict):
            out += schema_errors(item, extra, f"{path}.{key}", closed)
        elif not open_:
            known = sorted(k for k in props if not k.startswith("_"))
            listed = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
            out.append(f"{path}: unknown field {key!r} (known: {listed or 'none'})")
    return out


def _alternatives(value, schema: dict, path: str, closed: bool) -> list[str]:
    """anyOf (at least one), oneOf (exactly one), not (none)."""
    out = []
    if "anyOf" in schema:
        failed = [schema_errors(value, s, path, closed) for s in schema["anyOf"]]
        if all(failed):
            out.append(f"{path}: matches none of anyOf ({'; '.join(f[0] for f in failed)})")
    if "oneOf" in schema:
        passed = sum(not schema_errors(value, s, path, closed) for s in schema["oneOf"])
        if passed != 1:
            out.append(f"{path}: matches {passed} of oneOf's {len(schema['oneOf'])} alternatives, not 1")
    if "not" in schema and not schema_errors(value, schema["not"], path, closed):
        out.append(f"{path}: matches a schema it must not")
    return out


def _is(value, json_type: str) -> bool:
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[json_type])


def _bounds(path: str, n: int, schema: dict, low: str, high: str, what: str) -> list[str]:
    out = []
    if low in schema and n < schema[low]:
        out.append(f"{path}: {n} {what}, at least {schema[low]}")
    if high in schema and n > schema[high]:
        out.append(f"{path}: {n} {what}, at most {schema[high]}")
    return out


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
