"""Layer 5, training: the LightningModule, the Trainer built from the config, faults, signals and preemption, the
multi-process launch, and the pipeline that runs one training job. Reads the layers below; `exp.study` sits above it."""
