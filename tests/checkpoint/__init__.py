"""toolkit.checkpoint: the checkpoint format, bad checkpoint files, crash safety, exact resume, export and generate."""
