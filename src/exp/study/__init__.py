"""Layer 6, studies: a sweep's jobs as one study. Whose a sweep directory is and which earlier job a re-launch
reuses, one job of a multirun, the plan (each job's memory and time, where it would run), the `gpus` launcher's
scheduling and its journal, and the seed statistics of the report. Reads the layers below. The user commands
(`exp.train`, `exp.report`, ...) sit above it, at the top of the package."""
