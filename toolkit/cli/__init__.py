"""cli: the `toolkit` command. Thin: parse, call the library, map errors to exit codes.

main.py holds the sub-commands (run, validate, estimate, export, generate,
doctor, tutorials, ...); doctor.py gathers the environment report;
tutorials.py renders the notebook templates.

May import: every layer.
"""
