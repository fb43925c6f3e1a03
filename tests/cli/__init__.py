"""toolkit.cli: multi-process runs through the CLI, doctor, optional packages, tutorials and the installed package."""
