"""JSON schemas for the constraint engine's tests and benchmarks.

SCHEMAS: (name, schema) pairs llguidance compiles; every output generated
under one must validate against it (jsonschema, with format checks).
SAMPLES: a valid instance for some of them, for timing masks on real tokens.
UNSUPPORTED: (name, response_format, expected words of the ConstraintError):
malformed bodies, broken schemas, and keywords llguidance does not implement
(they are refused, never silently ignored).
"""

import json


def _rf(schema, **spec):
    return {"type": "json_schema", "json_schema": {"name": "corpus", "schema": schema, **spec}}


def _closed(properties, required=None):
    """An object with exactly these properties (all required unless told)."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


def _unimplemented(name, schema, *keys):
    return (name, _rf(schema), "Unimplemented keys: " + json.dumps(list(keys)))


BOOL, INT = {"type": "boolean"}, {"type": "integer"}


SCHEMAS = [
    # -- objects
    ("person", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }),
    ("optional_fields", {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "nickname": {"type": "string", "maxLength": 12},
            "score": {"type": "number"},
        },
        "required": ["id"],
        "additionalProperties": False,
    }),
    ("nested_address", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "country": {"enum": ["FR", "JP", "IT", "DE"]},
                },
                "required": ["street", "zip", "country"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    }),
    ("deep_nesting", _closed({"a": _closed({"b": _closed({"c": _closed({"d": INT})})})})),
    ("openai_strict_style", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "done": {"type": "boolean"},
            "due": {"type": ["string", "null"], "format": "date"},
            "priority": {"type": "integer", "enum": [1, 2, 3]},
        },
        "required": ["title", "done", "due", "priority"],
        "additionalProperties": False,
    }),
    ("booleans", _closed({"a": BOOL, "b": BOOL, "c": BOOL})),
    ("nulls", {
        "type": "object",
        "properties": {"nothing": {"type": "null"}, "maybe": {"type": ["integer", "null"]}},
        "required": ["nothing", "maybe"],
        "additionalProperties": False,
    }),
    ("const_property", {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "count": {"type": "integer", "minimum": 0}},
        "required": ["version", "count"],
        "additionalProperties": False,
    }),
    ("map_of_integers", {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxProperties": 3,
    }),
    ("pattern_properties", {
        "type": "object",
        "patternProperties": {"^x_[a-z]{1,4}$": {"type": "integer"}},
        "additionalProperties": False,
        "maxProperties": 2,
    }),
    ("all_of_merge", {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ],
    }),
    ("unicode_keys", _closed({
        "café": {"enum": ["crème", "thé", "日本"]},
        "say \"hi\"": {"const": "a\\b\n"},
    })),
    ("annotations_ignored", {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Thing",
        "description": "Annotations compile and change nothing.",
        "type": "object",
        "properties": {"n": {"type": "integer", "description": "a number", "examples": [3]}},
        "required": ["n"],
        "additionalProperties": False,
    }),
    # -- arrays
    ("array_of_numbers",
     {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 5}),
    ("array_of_objects", {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            },
            "required": ["id", "tags"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    }),
    ("fixed_length_array", {"type": "array", "items": BOOL, "minItems": 3, "maxItems": 3}),
    ("tuple_prefix_items", {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 8}, INT, BOOL],
        "items": False,
    }),
    ("empty_array_allowed", {"type": "array", "items": {"type": "integer"}, "maxItems": 0}),
    # -- enums, const, unions
    ("enum_strings", {"enum": ["red", "green", "blue"]}),
    ("enum_mixed", {"enum": ["a", 1, None, True, 2.5]}),
    ("const_object", {"const": {"ok": True, "items": [1, 2]}}),
    ("any_of_types", _closed({
        "v": {"anyOf": [{"type": "string", "maxLength": 6}, INT, {"type": "null"}]},
    })),
    ("one_of_discriminated", {
        "oneOf": [
            _closed({"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}}),
            _closed({"kind": {"const": "square"}, "side": INT}),
        ]
    }),
    ("type_list", {"type": ["integer", "boolean"]}),
    # -- $ref / $defs
    ("refs_defs", {
        "$defs": {
            "point": _closed({"x": INT, "y": INT}),
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    }),
    ("refs_definitions", {
        "definitions": {"level": {"enum": ["low", "high"]}},
        "type": "object",
        "properties": {"level": {"$ref": "#/definitions/level"}},
        "required": ["level"],
        "additionalProperties": False,
    }),
    ("recursive_tree", {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v", "kids"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    }),
    # -- numbers
    ("number_range", {"type": "number", "minimum": -10.5, "maximum": 10.5}),
    ("exclusive_bounds", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("integer_multiple_of", {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}),
    ("negative_integers", {"type": "integer", "maximum": -1, "minimum": -500}),
    # -- strings
    ("string_lengths", {"type": "string", "minLength": 2, "maxLength": 5}),
    ("string_pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}),
    ("formats", {
        "type": "object",
        "properties": {
            "date": {"type": "string", "format": "date"},
            "time": {"type": "string", "format": "time"},
            "uuid": {"type": "string", "format": "uuid"},
            "ipv4": {"type": "string", "format": "ipv4"},
        },
        "required": ["date", "time", "uuid", "ipv4"],
        "additionalProperties": False,
    }),
    ("format_date_time", {"type": "string", "format": "date-time"}),
    ("format_email", {"type": "string", "format": "email", "maxLength": 40}),
    ("format_ipv6_hostname", {
        "type": "array",
        "prefixItems": [{"type": "string", "format": "ipv6"},
                        {"type": "string", "format": "hostname", "maxLength": 30}],
        "items": False,
        "minItems": 2,
    }),
]

# Valid instances, for mask timing (constraints.mask_cost) on real tokens.
SAMPLES = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "nested_address": {"name": "Bob",
                       "address": {"street": "1 rue de Rivoli", "zip": "75001", "country": "FR"}},
    "array_of_objects": [{"id": 1, "tags": ["a", "b"]}, {"id": 2, "tags": []}],
    "formats": {"date": "2024-02-29", "time": "12:30:00Z",
                "uuid": "123e4567-e89b-12d3-a456-426614174000", "ipv4": "192.168.0.1"},
    "recursive_tree": {"v": 1, "kids": [{"v": 2, "kids": []},
                                        {"v": 3, "kids": [{"v": 4, "kids": []}]}]},
}

UNSUPPORTED = [
    # -- malformed bodies
    ("not_an_object", ["json_object"], "response_format must be an object"),
    ("unknown_type", {"type": "xml"}, "response_format.type must be"),
    ("missing_json_schema", {"type": "json_schema"}, "json_schema must be an object"),
    ("schema_not_object", _rf([1, 2]), "schema must be a JSON schema object"),
    ("schema_missing", {"type": "json_schema", "json_schema": {"name": "x"}}, "schema must be"),
    ("bad_name", _rf({"type": "object"}, name="has spaces"), "name must be"),
    ("bad_strict", _rf({"type": "object"}, strict="yes"), "strict must be a boolean"),
    # -- broken schemas
    ("unknown_json_type", _rf({"type": "object", "properties": {"a": {"type": "foo"}}}),
     "Invalid type"),
    ("dangling_ref", _rf({"$ref": "#/$defs/missing"}), "does not exist"),
    ("remote_ref", _rf({"$ref": "https://example.com/schema.json"}), "not present"),
    ("unsatisfiable", _rf({"allOf": [{"type": "string"}, {"type": "integer"}]}), "Unsatisfiable"),
    ("lookaround_pattern", _rf({"type": "string", "pattern": "(?=a)b"}), "look-around"),
    ("unknown_format", _rf({"type": "string", "format": "bogus"}), "Unknown format"),
    # -- keywords llguidance does not implement (refused, not ignored)
    _unimplemented("unique_items", {"type": "array", "uniqueItems": True}, "uniqueItems"),
    _unimplemented("contains", {"type": "array", "contains": INT}, "contains"),
    _unimplemented("not", {"not": {"type": "string"}}, "not"),
    _unimplemented("if_then", {"if": {"type": "string"}, "then": {"maxLength": 3}}, "if", "then"),
    _unimplemented("dependent_required", {"type": "object", "dependentRequired": {"a": ["b"]}},
                   "dependentRequired"),
    _unimplemented("property_names", {"type": "object", "propertyNames": {"pattern": "^a"}},
                   "propertyNames"),
    _unimplemented("unevaluated_properties", {"type": "object", "unevaluatedProperties": False},
                   "unevaluatedProperties"),
    ("overlapping_one_of", _rf({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}),
     "oneOf"),
    ("min_properties_optional_keys",
     _rf({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}),
     "min/maxProperties"),
    ("format_uri_reference", _rf({"type": "string", "format": "uri-reference"}), "Unknown format"),
]
