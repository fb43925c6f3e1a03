"""models: building the network a recipe names, and calling any model on a batch.

presets.py holds the size presets' shapes (torch-free); build.py turns a
`ModelSpec` into a transformers model (GPT-2, Llama; a pretrained folder);
forward.py says what a batch is and what a forward may return.

May import: the ground floor (toolkit.errors, toolkit.specs).
"""
