"""checkpoint: atomic, verified, world-size independent checkpoints, and what reads them.

files.py is the layout (step dirs, `latest`, manifests, temp dirs, pruning);
state.py flattens state into tensors + JSON and captures RNGs; io.py saves
(one process or several ranks) and loads; resume.py holds the resume rules;
zero_shards.py is the ZeRO shard format (per-parameter pieces readable at any
world size and stage); engine_state.py is an engine's state and DeepSpeed's
save_checkpoint/load_checkpoint over it; checkpointer.py is the loop's
cadence; export.py writes a Hugging Face folder and generate.py samples text
from a checkpoint.

May import: the ground floor, toolkit.data (the run's tokenizer),
toolkit.models.
"""
