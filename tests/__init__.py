"""The test suite, one folder per package layer (toolkit/<layer> is tested in tests/<layer>); shared set-up in conftest.py and text_corpus.py."""
