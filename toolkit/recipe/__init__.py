"""recipe: a recipe file becomes a typed, frozen `toolkit.specs.Recipe`.

Owns reading the JSON (files.py: `extends`, size and nesting caps), CLI
`key=value` overrides (overrides.py), the JSON Schema and its defaults
(schema.py), the assembly of every spec with the checks that come with it
(assemble.py), the semantic checks that build nothing (checks.py), the
pipeline that runs them (load.py: `load_recipe`, `recipe_from_dict`), and the
DeepSpeed config converter (deepspeed/).
Torch-free: `toolkit validate` runs on it alone.

May import: toolkit.errors, toolkit.regular_files, toolkit.resources,
toolkit.specs, toolkit.data (the corpus files and tokenizer a recipe names are
checked here), toolkit.models (the size presets).
"""
