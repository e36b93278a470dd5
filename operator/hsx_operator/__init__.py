"""hsx operator: reconciles ExtractionJob resources into GPU Jobs and keeps their status true."""

__version__ = "0.1.0"
