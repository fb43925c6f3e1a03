"""runtime: the engine that trains one rank.

engine.py is DeepSpeed's shape (`initialize`, forward, `backward`, `step`);
precision.py is autocast and loss scaling; optim.py builds AdamW and the
warmup schedules; zero/ holds the data-parallel strategies (DDP, ZeRO 1-3,
CPU offload) behind one small interface; parallel/ holds tensor and
pipeline parallelism over a device mesh (recipe.parallel), behind the same
interface; cpu_threads.py picks the CPU thread count.

May import: everything below it: the ground floor, toolkit.recipe,
toolkit.data, toolkit.models, toolkit.ops, toolkit.observe, toolkit.checkpoint.
"""
