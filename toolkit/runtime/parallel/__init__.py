"""runtime/parallel: tensor and pipeline parallelism composed with data parallelism, on PyTorch's own
engines: DTensor tensor parallelism (torch.distributed.tensor.parallel) and torch.distributed.pipelining.

mesh.py is the DeviceMesh (dims pp, dp, tp) and where this rank sits in it; tensor_parallel.py the
column/row plans for GPT-2 and Llama attention and MLP; pipeline.py splits a transformers model into
stages and runs the schedules (GPipe, 1F1B, interleaved 1F1B); strategy.py is the engine's strategy over
the mesh (the interface of toolkit/runtime/zero/__init__.py: gradients averaged over dp, the global norm
over the whole mesh, AdamW on each rank's shard, layout-independent checkpoint pieces).

The engine (toolkit/runtime/engine.py) dispatches here only when recipe.parallel.tensor or .pipeline > 1;
with both 1 nothing here is imported and data parallelism runs as it always did.

May import: the ground floor, toolkit.models, toolkit.runtime (precision, optim).
"""
