"""Layer 1, the data: sources and files, per-format rendering, encoding and its cache, splits, batching (padded,
packed, padding-free), the DataModule. Reads `exp.core` only."""
