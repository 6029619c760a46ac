"""Layer 0, the foundation every other layer reads: the typed config schema, what each strategy means, the tools'
command line, the cache. Torch-free: importing it never imports torch, Lightning or transformers."""
