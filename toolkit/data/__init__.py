"""data: corpora, tokenizers, packing and the sharded, resumable batch stream.

corpus.py finds and reads the files a recipe names (text, JSONL, Parquet);
tokenizer.py trains or loads a tokenizer; cache.py keeps tokenized corpora
between runs; batches.py packs tokens into sequences and deals the global
batch to ranks (`Dataset`, `BatchStream`).

May import: the ground floor (toolkit.errors, toolkit.specs,
toolkit.optional_packages, toolkit.distributed).
"""
