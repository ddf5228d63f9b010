"""Tokenizers, chat templates, incremental detokenization and block hashing."""
