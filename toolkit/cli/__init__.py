"""cli: the `toolkit` command. Thin: parse, call the library, map errors to exit codes.

main.py holds the sub-commands (run, validate, estimate, export, generate,
doctor, tutorials, ...); convert.py and tune.py hold `toolkit convert` and
`toolkit tune`; doctor.py gathers the environment report; tutorials.py renders
the notebook templates.

May import: every layer.
"""
