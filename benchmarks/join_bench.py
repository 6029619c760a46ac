"""An exp.bench result side by side with a baseline measured in parts by other invocations.

    python benchmarks/join_bench.py EXP_JSON PART_JSON [PART_JSON ...]

The hand-written loop's 200 real-data steps take longer than one GPU command may run, so they are measured in parts
(`exp.bench first_step=N variant=baseline`); exp's 200 steps in one invocation. This joins the parts into one
baseline row (`exp.bench.report.join_parts`: the steps' times and real tokens end to end) and writes the report
exp.bench would have written had both sides run in one invocation (`reference=` with the parts does that on the
GPU): `<EXP_JSON stem>-joined.json` and `.md` beside EXP_JSON. The parts must have exp's settings and, in order,
cover its steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from exp.bench.markdown import markdown
from exp.bench.report import compare, reference_rows
from exp.bench.variants import Settings


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    exp_path, parts = Path(argv[0]), [Path(p) for p in argv[1:]]
    report = json.loads(exp_path.read_text())
    settings = Settings(**{**report["settings"], "micro_batch": report["settings"]["micro_batch"][0]})
    try:
        baseline = reference_rows(
            parts, settings, report["settings"]["micro_batch"], report["flops"], report["peak_tflops"]
        )
    except ValueError as e:
        print(f"join_bench: {e}", file=sys.stderr)
        return 2
    report["rows"] = baseline + [r for r in report["rows"] if not r["is_reference"]]
    report["command"] += " (joined with: " + ", ".join(f"`{json.loads(p.read_text())['command']}`" for p in parts) + ")"
    compare(report["rows"], report["parity_steps"], report["parity_tol"])
    out = exp_path.with_name(exp_path.stem + "-joined")
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report).split("\nPer-step losses:")[0])
    print(f"join_bench: wrote {out}.json and {out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
