"""`python -m exp.bench` (a user command, at the top of exp): exp's training step against the hand-written QLoRA
loop, on the same tokens (docs/bench.md).

The parent process (`cli`: arguments, the checks before any worker, `runner`: the loop over the variants, `report`
and `markdown`: the result) imports torch but never Lightning, transformers or PEFT: each variant runs in a worker
process of its own (`worker`), which loads them with its side (`run_baseline` over `baseline_loop`, or `run_exp`
over exp.training.fit with the `clock` and `profile`). `variants` holds what both processes share: the settings and
the variants' names.
"""
