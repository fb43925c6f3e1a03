"""toolkit.data: corpora, tokenizers, the token cache and batches; data recipes and bad data files."""
