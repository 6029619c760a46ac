"""Compare the two arms of benchmarks/study_check.sh: the study packed by memory and the same study one job at a time.

    python benchmarks/study_compare.py STUDY_DIR

Reads STUDY_DIR/{packed,alone}/placements.jsonl (every launch of each arm: the one-at-a-time arm may take several,
each re-launch skipping the jobs that completed), each completed job's summary.json, and the nvidia-smi samples
(smi_*.csv). Writes STUDY_DIR/study_compare.json and prints it as a short table.

Wall-clock of the packed arm: its launch's own measure (first job start to last job end). Of the one-at-a-time arm:
the sum of its completed jobs' seconds (each from the launcher starting it to its process's exit; jobs run one
after the other, so this is the study's wall-clock less the launcher's few seconds between jobs); attempts that a
deadline stopped are not counted, and their seconds are listed. When not every job ran alone, the arm's wall-clock
is extrapolated (mean seconds per completed job x jobs) and said so.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

TOLERANCE = 1e-3  # relative difference allowed between a job's final val/loss packed and alone


def events(sweep: Path) -> list[dict]:
    path = sweep / "placements.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def final_val_loss(sweep: Path, run_dir: str) -> float | None:
    try:
        summary = json.loads((sweep / run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    value = (summary.get("final_val") or {}).get("val/loss")
    return float(value) if value is not None else None


def smi(files: list[Path]) -> dict:
    util, used = [], []
    for f in files:
        for row in csv.reader(f.open()):
            try:
                util.append(float(row[1]))
                used.append(float(row[2]))
            except (IndexError, ValueError):
                continue  # a header or a line cut by the stop
    if not util:
        return {"samples": 0}
    return {
        "samples": len(util),
        "gpu_util_mean_pct": round(statistics.mean(util), 1),
        "gpu_util_median_pct": statistics.median(util),
        "memory_used_max_gib": round(max(used) / 1024, 2),
    }


def arm(work: Path, name: str) -> dict:
    sweep = work / name
    evs = events(sweep)
    plans = [e for e in evs if e["event"] == "plan"]
    jobs = [j["job"] for j in plans[0]["jobs"]] if plans else []
    completed: dict[str, dict] = {}
    stopped = []
    for e in evs:
        if e["event"] != "end":
            continue
        if e["status"] == "completed":
            run_dir = e.get("run_dir") or e["job"]
            completed[e["job"]] = {
                "run_dir": run_dir,
                "seconds": e["seconds"],
                "val_loss": final_val_loss(sweep, run_dir),
                "peak_gib": e.get("peak_gib"),
                "estimate_allocated_gib": e.get("estimate_allocated_gib"),
            }
        else:
            stopped.append({"job": e["job"], "status": e["status"], "seconds": e["seconds"]})
    launches = [{"launch": e["launch"], "wall_clock_s": e["wall_clock_s"]} for e in evs if e["event"] == "launch_end"]
    running = [e.get("running_before", 0) + 1 for e in evs if e["event"] == "start"]
    out = {
        "jobs": len(jobs),
        "completed": len(completed),
        "complete": bool(jobs) and len(completed) == len(jobs),
        "launches": len(plans),
        "launch_wall_clock_s": launches,
        "max_jobs_at_once": max(running, default=0),
        "planned_wall_clock_s": plans[0].get("wall_clock_s") if plans else None,
        "not_completed_attempts": stopped,
        "per_job": completed,
        "smi": smi(sorted(work.glob(f"smi_{name}*.csv"))),
    }
    seconds = [c["seconds"] for c in completed.values()]
    out["sum_of_job_seconds"] = round(sum(seconds), 1)
    if seconds and not out["complete"]:
        out["extrapolated_wall_clock_s"] = round(statistics.mean(seconds) * len(jobs), 1)
    return out


def main(work: Path) -> dict:
    packed, alone = arm(work, "packed"), arm(work, "alone")
    result: dict = {"packed": packed, "alone": alone}
    packed_wall = packed["launch_wall_clock_s"][0]["wall_clock_s"] if packed["launch_wall_clock_s"] else None
    alone_wall = alone["sum_of_job_seconds"] if alone["complete"] else alone.get("extrapolated_wall_clock_s")
    result["packed_wall_clock_s"] = packed_wall
    result["alone_wall_clock_s"] = alone_wall
    result["alone_wall_clock_is"] = "measured" if alone["complete"] else "extrapolated"
    if packed_wall and alone_wall:
        result["ratio_packed_over_alone"] = round(packed_wall / alone_wall, 4)
    diffs = {}
    for job, a in alone["per_job"].items():
        p = packed["per_job"].get(job)
        if p and p["val_loss"] is not None and a["val_loss"] is not None:
            diffs[job] = {
                "packed": p["val_loss"],
                "alone": a["val_loss"],
                "rel_diff": abs(p["val_loss"] - a["val_loss"]) / abs(a["val_loss"]),
            }
    result["val_loss"] = diffs
    result["jobs_compared"] = len(diffs)
    result["max_rel_diff"] = max((d["rel_diff"] for d in diffs.values()), default=None)
    result["all_within_tolerance"] = bool(diffs) and all(d["rel_diff"] <= TOLERANCE for d in diffs.values())
    (work / "study_compare.json").write_text(json.dumps(result, indent=2))
    return result


def show(r: dict) -> None:
    for name in ("packed", "alone"):
        a = r[name]
        print(
            f"{name}: {a['completed']}/{a['jobs']} jobs completed in {a['launches']} launch(es); at most "
            f"{a['max_jobs_at_once']} at once; launch wall-clock {a['launch_wall_clock_s']}; sum of job seconds "
            f"{a['sum_of_job_seconds']}; planned {a['planned_wall_clock_s']}; nvidia-smi {a['smi']}; "
            f"attempts not completed: {len(a['not_completed_attempts'])}"
        )
    print(
        f"wall-clock: packed {r['packed_wall_clock_s']} s, one at a time {r['alone_wall_clock_s']} s "
        f"({r['alone_wall_clock_is']}); ratio {r.get('ratio_packed_over_alone')}"
    )
    print(
        f"final val/loss: {r['jobs_compared']} job(s) compared, max relative difference {r['max_rel_diff']}, all "
        f"within {TOLERANCE:g}: {r['all_within_tolerance']}"
    )


if __name__ == "__main__":
    show(main(Path(sys.argv[1])))
