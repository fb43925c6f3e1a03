"""observe: what a run measures and predicts.

estimate.py predicts memory per rank from a recipe (`toolkit estimate`);
memory_fit.py holds that estimate against the machine before training,
disk_fit.py a checkpoint and the swap files against the disks;
memory_monitor.py measures it while training,
step_memory_timeline.py op by op across one step; flops.py counts FLOPs for
MFU; trackers.py writes metrics to the console, JSONL, TensorBoard and W&B;
notebook.py holds what the tutorial notebooks measure and show with.
The engine reports into these (its state bytes), so they sit below runtime.

May import: the ground floor, toolkit.recipe.
"""
