"""toolkit.ops: kernel loading, the fused custom ops and modules, FusedAdamW, the padded LM head and the CPU Adam kernel."""
