"""runtime: the engine that trains one rank.

engine.py is DeepSpeed's shape (`initialize`, forward, `backward`, `step`);
precision.py is autocast and loss scaling; optim.py builds every optimizer
(one factory) and the warmup schedules; muon.py is Muon's parameter rule, its
whole-tensor optimizer (torch's Muon beside torch's AdamW) and the per-matrix maths; strategy.py is the typed `Strategy`
protocol every strategy implements; zero/ holds the data-parallel strategies
(DDP, 1-bit Adam, ZeRO 1-3, CPU offload); parallel/ holds tensor and pipeline
parallelism over a device mesh (recipe.parallel); cpu_threads.py picks the CPU
thread count. Below engine.py nothing reads a Recipe: the engine hands each
part its specs.

May import: everything below it: the ground floor, toolkit.recipe,
toolkit.data, toolkit.models, toolkit.ops, toolkit.observe, toolkit.checkpoint.
"""
