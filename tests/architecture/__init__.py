"""The import graph: the layer order of toolkit's subpackages, no cycles, no benchmark imports."""
