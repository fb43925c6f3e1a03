"""docs/: the generated pages agree with their sources (the recipe reference with the schema)."""
