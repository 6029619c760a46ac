"""Layer 3, placement: the memory estimate of a configuration and the preflight that checks it against what this
process can see and resolves every `auto`. Reads the layers below."""
