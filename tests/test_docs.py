"""Every command in README.md and docs/*.md works as written on a fresh clone (no data from outside the repository, no GPU, no hub).

The commands are read from the Markdown code blocks: each line of a ```bash block, and each `$ ` line of a
transcript together with what it printed (the lines up to a blank line or the next `$`). Nothing here trains, so
the file takes seconds; how each command is checked depends on what it runs (`check`):

- `python -m exp.train`: **composed**. Checked as the CLI checks it before Hydra starts
  (`exp.run.overrides.check_command_line`: composition, unknown keys, the `_target_` allow-list, run directories),
  composed into the typed config (every job of a grid sweep) and, for a config the CPU runs, preflighted for this
  CPU machine. A transcript that shows an error must show the message the command prints. The runs themselves are
  tested elsewhere: the default run end to end (test_default_run.py), short runs (test_training.py), resume
  (test_resume.py), sweeps (test_sweeps.py), DDP and torchrun (test_distributed.py). Commands for GPUs
  (`hardware=gpu`, `ddp`, ...) are composed only; their preflight on a GPU is test_preflight.py's.
- `python -m exp.preview`: **run**, on the files the docs show (a shown file is written as shown).
- `python -m exp.doctor`: **run**; this machine's verdict is compared with the transcript's.
- `python -m exp.evaluate` / `generate` / `merge`: **arguments parsed**: they need a finished run, and
  test_inference.py runs each on one.
- `python -m exp.bench`, `python -m exp.report`: **arguments parsed**: the bench is sized for a GPU (test_bench.py
  runs it on the tiny model), the report needs a sweep (test_sweeps.py).
- `make <target>`: `make -n` shows the documented command. `bash <script>` and a script block: `bash -n` parses them.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT, SHARED_DATA

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.M | re.S)
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
FAKE_SECRET = "fake-secret-0123456789"  # a `...` value of a secret-looking variable (WANDB_API_KEY=...)


@dataclass
class DocCommand:
    where: str  # file:line
    text: str
    output: list[str] = field(default_factory=list)  # what a transcript shows it printed
    script: str | None = None  # the whole block, for a line of a shell script

    @property
    def words(self) -> list[str]:
        return [w for w in shlex.split(self.text, comments=True) if w != "..."]  # `...`: elided arguments


def doc_commands() -> list[DocCommand]:
    commands = []
    for path in DOCS:
        text = path.read_text()
        for block in FENCE.finditer(text):
            indent, lang, body = block.groups()
            first = text[: block.start()].count("\n") + 2  # the line after the opening fence
            lines = [line.removeprefix(indent) for line in body.splitlines()]
            where = [f"{path.relative_to(ROOT)}:{first + i}" for i in range(len(lines))]
            if lang in ("bash", "sh"):
                script = body if lines and lines[0].startswith("#!") else None
                for i, line in enumerate(lines):
                    if line.strip() and not line.lstrip().startswith("#") and (script is None or "python" in line):
                        commands.append(DocCommand(where[i], line.strip(), script=script))
            elif lang == "":
                for i, line in enumerate(lines):
                    if line.startswith("$ "):
                        out = list(itertools.takewhile(lambda s: s.strip() and not s.startswith("$ "), lines[i + 1 :]))
                        commands.append(DocCommand(where[i], line[2:].strip(), out))
    return commands


COMMANDS = doc_commands()


def split(cmd: DocCommand) -> tuple[dict[str, str], str, list[str]]:
    """(environment, what runs: `exp.<module>` / `make` / `bash` / `echo`, its arguments)."""
    words = cmd.words
    env = {}
    while words and ENV_ASSIGNMENT.match(words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = FAKE_SECRET if value in ("", "...") else value
    if words[0] == "torchrun":  # the environment torchrun gives each rank: a shared id unless the rendezvous is static
        flags = words[: words.index("-m")]
        static = any(
            w.startswith(("--master_port", "--master-port", "--rdzv-endpoint", "--rdzv_endpoint")) for w in flags
        )
        # --standalone and --rdzv-id share one; so does torchrun on one machine with neither a port nor an endpoint
        # (it picks a rendezvous id itself).
        shared = any(w == "--standalone" or w.startswith("--rdzv-id") for w in flags) or not static
        nproc = next((w.split("=")[1] for w in words if w.startswith("--nproc_per_node=")), "1")
        env.update(WORLD_SIZE=nproc, TORCHELASTIC_RUN_ID="8e82e497-doc" if shared else "none")
    if words[0] in ("srun", "torchrun"):  # launchers: what they start is `-m <module> <args>`
        words = ["python", *words[words.index("-m") :]]
    if words[:2] == ["python", "-m"]:
        return env, words[2], words[3:]
    return env, words[0], words[1:]


def test_every_command_is_found_and_of_a_known_kind():
    kinds = [split(c)[1] for c in COMMANDS]
    assert len(COMMANDS) > 60 and kinds.count("exp.train") > 25
    unknown = {c.where: c.text for c, kind in zip(COMMANDS, kinds, strict=True) if kind not in CHECKS}
    assert not unknown, f"add a check for these commands (tests/test_docs.py): {unknown}"


# --- exp.train: composed ---------------------------------------------------------------------------------------


def cli_check(args: list[str]):
    """What `python -m exp.train <args>` checks before Hydra starts: (the error it prints or None, the typed config
    of a single run or None)."""
    from hydra._internal.utils import get_args_parser

    import exp.run.compose
    import exp.train
    from exp.core.config import ConfigError
    from exp.core.secrets import mask_secrets
    from exp.run.overrides import check_command_line, expand_seeds

    args, problems = expand_seeds([a for a in args if a != "--plan"])  # as exp.train's command line does first
    if not problems:
        problems, _ = check_command_line(args, exp.train.__file__, str(exp.run.compose.CONF_DIR), "train")
    if problems:
        return "exp: error: " + mask_secrets("\n".join(problems)), None
    parsed = get_args_parser().parse_args(args)
    if parsed.config_dir or parsed.multirun:
        return None, None  # a sweep: its jobs are composed in `check_train`
    try:
        return None, exp.run.compose.compose_config(parsed.overrides)
    except ConfigError as e:
        return f"exp: error: {mask_secrets(str(e))}", None


def grid_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs of a grid sweep: one override list per combination of comma-separated values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for text, override in zip(overrides, OverridesParser.create().parse_overrides(overrides), strict=True):
        if override.get_key_element().startswith("hydra"):
            continue  # the launcher, the sweep directory: Hydra's, not the job's config
        key = text.split("=", 1)[0]
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [text.split("=", 1)[1]]
        choices.append([f"{key}={v}" for v in values])
    return [list(job) for job in itertools.product(*choices)]


def check_train(cmd: DocCommand, env: dict[str, str], args: list[str], monkeypatch, capsys) -> None:
    from hydra._internal.utils import get_args_parser

    import exp.run.compose
    import exp.train
    from exp.core.config import ConfigError
    from exp.hardware.preflight import Environment, Gpu, check, format_findings

    monkeypatch.chdir(ROOT)  # as typed in the clone's root (`--config-dir sweeps`, relative run directories)
    # The data files the docs name are the reader's own (or downloaded); the early data checks are test_data_files.py's.
    monkeypatch.setattr("exp.run.overrides._data_problems", lambda cfg: [])
    # So are the earlier runs a command starts from (model.adapter=): test_preference_flow.py runs that workflow.
    monkeypatch.setattr("exp.run.typed.resolve_start_adapter", lambda cfg, launch_dir, quiet=False: cfg)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    expected = "\n".join(cmd.output)
    # The preflight's verdict, after the notes it logs first (a transcript shows the whole console).
    verdict = expected[expected.find("exp: preflight") :] if "exp: preflight" in expected else None
    from exp.run.dirs import shared_launch_id

    if shared_launch_id(env) == "":  # a rank of a launch without a shared id: refused before anything else
        with pytest.raises(SystemExit) as stop:
            monkeypatch.setattr("sys.argv", ["exp.train", *args])
            exp.train._cli()
        assert stop.value.code == 2 and capsys.readouterr().err.strip() == expected
        return
    from exp.run.overrides import expand_seeds

    if not expected.startswith("exp: error:"):
        args, _ = expand_seeds([a for a in args if a != "--plan"])  # the sweep exp.train runs (or plans)
    message, cfg = cli_check(args)
    if expected.startswith("exp: error:"):
        assert message == expected
        return
    assert message is None, message
    if cfg is None:  # a sweep: every job of a grid composes, or fails as the transcript shows it fail
        parsed = get_args_parser().parse_args(args)
        if not parsed.config_dir:
            jobs = grid_jobs(parsed.overrides)
            assert len(jobs) > 1
            for job in jobs:
                try:
                    exp.run.compose.compose_config(job)
                except ConfigError as e:  # the sweep records the job as failed with this message, and goes on
                    assert any(f": {e}" in line for line in cmd.output), f"{cmd.where}: {job} fails: {e}"
        return
    # The preflight, for the machine the command is shown on: this CPU machine, or for the transcript naming
    # CUDA_VISIBLE_DEVICES the H200 machine it was recorded on (one GPU visible). GPU commands without a transcript
    # are composed only.
    if "CUDA_VISIBLE_DEVICES" in env:
        h200 = Gpu("NVIDIA H200", 143 * 2**30, 140 * 2**30, (9, 0))
        machine = Environment(cuda_visible_devices=env["CUDA_VISIBLE_DEVICES"], torch_cuda="13.0", gpus=[h200])
    elif cfg.hardware.accelerator.value in ("cpu", "auto") or verdict:
        machine = Environment()  # torch_cuda None: a CPU build of torch, no GPU
    else:
        return
    result = check(cfg, machine)
    if verdict:
        assert format_findings(result) == verdict
    else:
        assert result.ok, format_findings(result)
        assert not [n for n in result.notes if "warmup" in n], result.notes  # short runs keep a full schedule


# --- the other commands -----------------------------------------------------------------------------------------


def doc_block(doc: str, after: str) -> str:
    """The first code block of `doc` after the text `after` (a heading, or the marker naming a file it shows)."""
    text = (ROOT / doc).read_text()
    return FENCE.search(text, text.index(after)).group(3)


def check_preview(cmd: DocCommand, args: list[str], tmp_path, monkeypatch, capsys, caplog) -> None:
    from exp.preview import main

    monkeypatch.chdir(tmp_path)
    paths = [a.split("=", 1)[1] for a in args if a.startswith("data.path=")]
    # A mixture names its sources' files inside the override: data.mixture=[{path: a.jsonl, ...}, ...]
    paths += [p for a in args if a.startswith("data.mixture=") for p in re.findall(r"\bpath: ([^,}\s]+)", a)]
    path = paths[0]
    real = SHARED_DATA / path if SHARED_DATA else None
    if path == "alpaca_en_demo.json" and real and real.exists():  # the README's download
        shutil.copy(real, path)
    elif path == "alpaca_en_demo.json":  # a fresh clone: the README's example of the format, enough for a split
        Path(path).write_text(json.dumps(json.loads(doc_block("README.md", "### Your own data")) * 10))
    else:
        for p in paths:
            Path(p).write_text(doc_block("docs/data.md", f"<!-- file: {p} -->"))
    assert main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    logged = "\n".join(caplog.messages)  # what the CLI's log handler prints (bad rows)
    printed = "\n".join([logged, out.err, out.out]).replace(f"{tmp_path}/", "").splitlines()  # paths as typed
    if path == "alpaca_en_demo.json" and not (real and real.exists()):
        return  # the transcript is of the real file
    missing = [line for line in cmd.output if line.strip() != "..." and line not in printed]
    assert not missing, f"{cmd.where}: lines the command does not print (any more): {missing}"


def check_doctor(cmd: DocCommand, args: list[str], capsys) -> None:
    import torch

    from exp.doctor import main

    code = main(args)
    if torch.cuda.is_available():  # the transcripts are of a machine without a GPU
        assert code in (0, 3)
        return
    assert code == 3  # the verdict on the GPU commands: this torch is a CPU build
    printed = capsys.readouterr().out.splitlines()
    verdict = printed[printed.index("== verdict ==") + 1 :]
    shown = [line for line in cmd.output if line.startswith(("PROBLEM", "OK"))]
    assert verdict and all(line in verdict for line in shown)


def check_run_command(cmd: DocCommand, args: list[str], module: str) -> None:
    import importlib

    from exp.core.cli import parse
    from exp.core.config import ConfigError

    tool = importlib.import_module(module).TOOL
    if any(line.startswith("exp: error:") for line in cmd.output):  # a documented refusal: the same words
        with pytest.raises(ConfigError) as refused:
            parse(tool, args)
        assert f"exp: error: {refused.value}" in cmd.output
        return
    parsed = parse(tool, args)
    assert parsed.values.get("run") or parsed.values.get("ckpt")


def check_bench(args: list[str], tmp_path, monkeypatch) -> None:
    from exp.bench.cli import parse_args

    data = next((a.split("=", 1)[1] for a in args if a.startswith("data=")), None)
    if data is not None:  # real-data mode: the file must exist (the README's example of the format stands in)
        monkeypatch.chdir(tmp_path)
        Path(data).write_text(json.dumps(json.loads(doc_block("README.md", "### Your own data")) * 10))
    parse_args(args)


def check_report(args: list[str], capsys) -> None:
    from exp.report import main

    assert main(args) == 2 and "no such directory" in capsys.readouterr().err  # a placeholder sweep directory


def check_make(args: list[str]) -> None:
    dry = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    target = args[0]
    assert {"train": "-m exp.train", "test": "-m pytest"}[target] in dry.stdout


def check_bash(cmd: DocCommand, args: list[str]) -> None:
    if cmd.script is not None:
        script = cmd.script
    else:
        assert (ROOT / args[0]).is_file(), f"{cmd.where}: no {args[0]}"
        script = (ROOT / args[0]).read_text()
    parsed = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=60)
    assert parsed.returncode == 0, parsed.stderr


CHECKS = {
    "exp.train": "composed",
    "exp.preview": "run",
    "exp.doctor": "run",
    "exp.evaluate": "arguments parsed",
    "exp.generate": "arguments parsed",
    "exp.merge": "arguments parsed",
    "exp.bench": "arguments parsed",
    "exp.report": "arguments parsed",
    "make": "make -n",
    "bash": "bash -n",
    "python": "a script under benchmarks/: it exists and compiles",
    "echo": "the exit status a transcript shows: part of the command before it",
    "curl": "a download (no network in tests): the file a later command reads, which check_preview stands in for",
}


# Refusals that need what an earlier command left (a sweep directory holding another study, a finished run, a
# directory of something else) or a launch (the `gpus` launcher's check of the machine): not reproducible from the
# command alone; the test named creates the state and checks the message.
STATEFUL = {
    "already holds a job": "tests/test_sweeps.py",
    "already holds another study": "tests/test_sweeps.py",
    "is being written by another launch": "tests/test_sweeps.py",
    "never writes over a run": "tests/test_inference.py",
    "not an exp run's": "tests/test_run_dirs.py",
    "runs each job on a GPU of its own": "tests/test_sweeps.py",
}


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{c.where} {c.text[:60]}")
def test_documented_command(cmd: DocCommand, tmp_path, monkeypatch, capsys, caplog):
    env, kind, args = split(cmd)
    stateful = [k for k in STATEFUL if any(k in line for line in cmd.output)]
    if stateful:
        for k in stateful:
            assert k in (ROOT / STATEFUL[k]).read_text(), f"{cmd.where}: {STATEFUL[k]} does not check {k!r}"
        return
    if cmd.script is not None or kind == "bash":
        check_bash(cmd, args)
    if kind == "exp.train":
        check_train(cmd, env, args, monkeypatch, capsys)
    elif kind == "exp.preview":
        check_preview(cmd, args, tmp_path, monkeypatch, capsys, caplog)
    elif kind == "exp.doctor":
        check_doctor(cmd, args, capsys)
    elif kind in ("exp.evaluate", "exp.generate", "exp.merge"):
        check_run_command(cmd, args, kind)
    elif kind == "exp.bench":
        check_bench(args, tmp_path, monkeypatch)
    elif kind == "exp.report":
        check_report(args, capsys)
    elif kind == "make":
        check_make(args)
    elif kind == "python":
        assert args[0].startswith("benchmarks/") and (ROOT / args[0]).is_file(), f"{cmd.where}: no {args[0]}"
        compile((ROOT / args[0]).read_text(), args[0], "exec")
    elif kind == "curl":  # -LO <url>: saved under the URL's file name, which the commands after it read
        name = args[-1].rsplit("/", 1)[-1]
        assert args[-1].startswith("https://") and "-LO" in args
        same_doc = [c for c in COMMANDS if c.where.split(":")[0] == cmd.where.split(":")[0]]
        assert any(f"data.path={name}" in c.text for c in same_doc)
    else:
        assert kind in CHECKS, f"{cmd.where}: no check for {cmd.text!r}"


# --- the generated figures --------------------------------------------------------------------------------------


def readme_figures():
    """benchmarks/readme_figures.py, imported (it needs only the standard library to be read)."""
    import importlib.util
    import sys

    if "readme_figures" not in sys.modules:
        spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "benchmarks" / "readme_figures.py")
        sys.modules["readme_figures"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
        spec.loader.exec_module(sys.modules["readme_figures"])
    return sys.modules["readme_figures"]


def test_every_figure_block_has_its_generator_and_is_well_formed():
    """Each `<!-- readme_figures:<name> -->` block of the docs is regenerated by benchmarks/readme_figures.py, into
    the file that holds it, and every generator there has its block; each block opens and closes once, at the
    same indentation, and holds whole code fences."""
    figures = readme_figures()
    found: dict[str, str] = {}
    for path in DOCS:
        text, doc = path.read_text(), str(path.relative_to(ROOT))
        markers = re.findall(r"^( *)<!-- (/?)readme_figures:([\w-]+) -->$", text, re.M)
        loose = re.findall(r"<!-- /?readme_figures:[^>]*-->", text)
        assert len(loose) == len(markers), f"{doc}: a marker not on a line of its own: {loose}"
        opened = [(indent, name) for indent, close, name in markers if not close]
        closed = [(indent, name) for indent, close, name in markers if close]
        assert opened == closed, f"{doc}: markers that do not pair up (name and indentation): {opened} vs {closed}"
        blocks = figures.blocks_in(text)
        assert blocks == [name for _, name in opened], f"{doc}: nested or unclosed blocks"
        for block in figures.MARKER.finditer(text):
            indent, name, body = block.groups()
            assert name not in found, f"block {name} is in {found[name]} and in {doc}"
            found[name] = doc
            fences = [line for line in body.splitlines() if line.strip().startswith("```")]
            assert len(fences) % 2 == 0, f"{doc}: block {name} cuts a code fence"
            assert all(not line.strip() or line.startswith(indent) for line in body.splitlines()), name
            # Written back unchanged: what the generator's output replaces is exactly the block's body.
            unindented = "\n".join(line.removeprefix(indent) for line in body.splitlines())
            assert figures.replace_block(text, name, unindented) == text, f"{doc}: block {name}"
    generators = {name: figure.doc for name, figure in figures.FIGURES.items()}
    assert found == generators, (
        f"blocks without a generator: {sorted(set(found) - set(generators))}; generators without a block: "
        f"{sorted(set(generators) - set(found))}; in another file: "
        f"{sorted(n for n in set(found) & set(generators) if found[n] != generators[n])}"
    )
    assert {"default-run", "alpaca-run", "preview-alpaca", "doctor", "torchrun"} <= set(found)
