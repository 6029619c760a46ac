"""`python -m exp.bench`: exp's training step against the hand-written QLoRA loop (`exp.bench.cli`)."""
