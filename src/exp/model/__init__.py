"""Layer 2, the model: a (4-bit) Gemma loaded on a device and wrapped with LoRA, the facts of each Gemma family (one
row each), the random-weight checkpoints the project builds, kept dequantized weights, the training loss, the
validation metrics. Reads `exp.core`, and `exp.data`'s generated task (the corpus of the local tokenizer)."""
