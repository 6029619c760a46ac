"""Layer 4, the run's records: its directory layout, logs, tracking, checkpoint files, continuation, the command
line's checks, loading a finished run. Reads the layers below."""
