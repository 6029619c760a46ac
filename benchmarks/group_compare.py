"""Compare the arms of benchmarks/group_check.sh: a study whose jobs share one base (`grouped`) and the same study
packed by memory (`packed`), and optionally an earlier recorded arm (a sweep directory given as REFERENCE).

    python benchmarks/group_compare.py WORK [REFERENCE]

Per arm: the wall-clock (its launch's own measure in placements.jsonl, first start to last end), the jobs completed,
nvidia-smi's utilisation (mean, median) and highest memory reading (WORK/smi_<arm>.csv), the highest allocation peak
a job's summary reports (a group's process reports the group's), and the model FLOPs utilisation: the real tokens
trained (the grouped jobs' `tokens_trained`; both arms train the same examples, same seeds) x FLOPs per token
(exp.bench.report.model_flops_per_token at data.max_seq_len) / (wall-clock x the GPU's bf16 peak). Per job: the
final val/loss of each arm against the grouped one (relative). Writes WORK/group_compare.json and prints it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout, as the other scripts

from study_compare import smi  # noqa: E402  (beside this script: nvidia-smi's samples read as the study's are)

TOLERANCE = 1e-3  # relative difference of a job's final val/loss between arms


def events(sweep: Path) -> list[dict]:
    path = sweep / "placements.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def jobs(sweep: Path) -> dict[str, dict]:
    """Each completed job's summary, keyed by its overrides (the directory name less its number)."""
    out = {}
    for d in sorted(sweep.iterdir()) if sweep.is_dir() else []:
        try:
            summary = json.loads((d / "summary.json").read_text())
            status = json.loads((d / "status.json").read_text())["status"]
        except (OSError, ValueError, KeyError):
            continue
        if status == "completed":
            # A re-launch's attempt (<job>_1) stands for its job.
            name = re.sub(r"_\d+$", "", d.name) if (sweep / re.sub(r"_\d+$", "", d.name)).is_dir() else d.name
            out[name.split("_", 1)[-1]] = {**summary, "run_dir": d}
    return out


def wall_clock(sweep: Path) -> float | None:
    """The last launch's own measure; None when an earlier launch of the arm was cut (its time is not in it)."""
    plans = [e for e in events(sweep) if e.get("event") == "plan"]
    ends = [e["wall_clock_s"] for e in events(sweep) if e.get("event") == "launch_end"]
    return float(ends[-1]) if ends and len(ends) == len(plans) else None


def flops_per_token(run_dir: Path) -> float:
    from exp.bench.report import model_flops_per_token
    from exp.hardware.memory import config_arch
    from exp.run.compose import load_run_config

    cfg = load_run_config(run_dir)
    return float(model_flops_per_token(config_arch(cfg), cfg.data.max_seq_len)["per_token"])


def main(work: Path, reference: Path | None) -> dict:
    from exp.bench.report import H200_BF16_TFLOPS

    arms = {a: work / a for a in ("grouped", "packed") if (work / a).is_dir()}
    if reference is not None:
        arms["reference"] = reference
    found = {a: jobs(d) for a, d in arms.items()}
    grouped = found.get("grouped", {})
    tokens = sum(s.get("tokens_trained") or 0 for s in grouped.values())
    per_token = flops_per_token(next(iter(grouped.values()))["run_dir"]) if grouped else None
    result: dict = {"arms": {}, "jobs": {}, "tolerance": TOLERANCE, "peak_tflops": H200_BF16_TFLOPS}
    for a, d in arms.items():
        wall = wall_clock(d)
        peaks = [s.get("peak_memory_gib") for s in found[a].values() if s.get("peak_memory_gib")]
        mfu = tokens * per_token / (wall * H200_BF16_TFLOPS * 1e12) if wall and per_token and tokens else None
        result["arms"][a] = {
            "completed": len(found[a]),
            "wall_clock_s": wall,
            **smi([p for p in [work / f"smi_{a}.csv"] if p.exists()]),
            "peak_allocated_gib": max(peaks) if peaks else None,
            "mfu": round(mfu, 4) if mfu else None,
        }
    for name, s in grouped.items():
        row = {"grouped": s["final_val"]["val/loss"]}
        for a in arms:
            if a != "grouped" and name in found[a]:
                other = found[a][name]["final_val"]["val/loss"]
                row[a] = other
                row[f"{a}_rel_diff"] = abs(row["grouped"] / other - 1)
        result["jobs"][name] = row
    for a in arms:
        if a != "grouped":
            diffs = [r[f"{a}_rel_diff"] for r in result["jobs"].values() if f"{a}_rel_diff" in r]
            result["arms"][a]["max_rel_diff_vs_grouped"] = max(diffs) if diffs else None
            g, o = (
                result["arms"]["grouped"]["wall_clock_s"] if "grouped" in arms else None,
                result["arms"][a]["wall_clock_s"],
            )
            result["arms"][a]["grouped_over_this"] = round(g / o, 3) if g and o else None
    result["tokens_trained"] = tokens
    (work / "group_compare.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["arms"], indent=2))
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
