"""data: corpora, tokenizers, packing and the sharded, resumable batch stream.

paths.py lists the files a recipe names (${variables}, globs, excludes);
corpus.py reads the documents in them (text, JSONL, Parquet); tokenizer.py
trains or loads a tokenizer; cache.py keeps tokenized corpora between runs;
batches.py packs tokens into sequences and deals the global
batch to ranks (`Dataset`, `BatchStream`).

May import: the ground floor (toolkit.errors, toolkit.regular_files,
toolkit.specs, toolkit.optional_packages, toolkit.distributed).
"""
