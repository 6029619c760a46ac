"""Layer 1, the data: sources and files, per-format rendering, tokenisation, splits, packing, the DataModule. Reads
`exp.core` and the tokenizer builder of `exp.model`."""
