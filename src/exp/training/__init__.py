"""Layer 5, training: the LightningModule, the Trainer built from the config, faults, signals and preemption, the
multi-process launch, and the pipeline that runs one training job. Reads the layers below. The user commands
(`exp.train`, `exp.evaluate`, ...) sit above it, at the top of the package."""
