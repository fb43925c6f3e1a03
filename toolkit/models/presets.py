"""Architecture shapes of the size presets (no torch here: `toolkit validate` reads it).

GPT-2 shapes are the GPT-2 paper's (Radford et al. 2019, table 2); llama shapes
follow common small-Llama research configs and TinyLlama-1.1B for `1b`.
"""

# NOTE: `tiny` presets exist so a CPU trains them in seconds; their widths are
# the smallest that still exercise every code path (several heads, GQA).
GPT2_SHAPES = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4),
    "124m": dict(n_layer=12, n_embd=768, n_head=12),
    "350m": dict(n_layer=24, n_embd=1024, n_head=16),
    "774m": dict(n_layer=36, n_embd=1280, n_head=20),
    "1.5b": dict(n_layer=48, n_embd=1600, n_head=25),
}

LLAMA_SHAPES = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=176),
    "60m": dict(n_layer=8, n_embd=512, n_head=8, n_kv_head=8, intermediate_size=1376),
    "250m": dict(n_layer=24, n_embd=768, n_head=16, n_kv_head=16, intermediate_size=2560),
    "1b": dict(n_layer=22, n_embd=2048, n_head=32, n_kv_head=4, intermediate_size=5632),
}

SHAPES = {"gpt2": GPT2_SHAPES, "llama": LLAMA_SHAPES}
