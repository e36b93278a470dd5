"""Shards in an object store, committed exactly once. Knows nothing of runs, servers or tokenizers."""
