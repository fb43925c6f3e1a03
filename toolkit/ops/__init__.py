"""ops: the fused kernels as torch sees them.

loader.py says which C++/CUDA extensions over kernels/ to build and load, the CPU
Adam kernel's too (fallback, status for `toolkit doctor`); build_cache.py builds and
imports them in the cache (JIT, one lock per build); toolchain.py finds nvcc and the target
architectures; custom_ops.py registers the torch custom ops (norms, bias+GeLU,
cross-entropy) with their torch references; fused_modules.py swaps a model's
modules for fused ones; fused_adamw.py and cpu_adam.py are the optimizer
kernels' torch faces.

May import: the ground floor (toolkit.errors, toolkit.resources,
toolkit.distributed).
"""
