"""toolkit.runtime: the engine and its Python API, optimizers and schedules, precision, CPU threads and the ZeRO stages."""
