"""hsx extractor: dataset -> exact tokens -> server dumps -> validated shards in object storage."""

__version__ = "0.1.0"
