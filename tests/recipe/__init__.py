"""toolkit.recipe: loading, validation, extends, overrides and the schema, through the real `toolkit validate`."""
