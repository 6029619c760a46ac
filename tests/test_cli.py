"""One command-line style for every `python -m exp.<tool>`: `key=value` arguments, `--help` that lists what the tool
takes, and one paragraph naming a bad argument and its fix, with exit status 2. In-process (the tools parse before
importing anything heavy); exp.train's exit status once through a real process."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

TOOLS = ["exp.evaluate", "exp.generate", "exp.merge", "exp.report", "exp.bench", "exp.doctor", "exp.preview"]


# The module holding a command's `main`, where the command is a package.
MAIN = {"exp.bench": "exp.bench.cli"}


def exit_status(module: str, argv: list[str]) -> int:
    """The tool's main() as `python -m <module> <argv>` runs it."""
    try:
        code = importlib.import_module(MAIN.get(module, module)).main(argv)
    except SystemExit as e:
        code = e.code
    return code or 0


def tool_of(module: str):
    mod = importlib.import_module(MAIN.get(module, module))
    return mod.bench_tool() if module == "exp.bench" else mod.TOOL


@pytest.mark.parametrize("module", TOOLS)
def test_help_lists_every_key_of_the_tool(module, capsys):
    assert exit_status(module, ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {module} ")
    tool = tool_of(module)
    for key in tool.keys:
        assert (f"  {key.name}=" in out) != key.hidden, key.name
    if tool.hydra:  # doctor, preview: their own keys, and exp.train's config overrides
        assert "any config override of exp.train" in out and "verbose=true" in out


def test_train_help_says_what_it_takes(tmp_path):
    # A process of its own: Hydra's --help configures the logging of the process it runs in.
    proc = subprocess.run([sys.executable, "-m", "exp.train", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python -m exp.train [key=value ...] [-m] [-v]")
    assert "-v (--verbose) is verbose=true" in proc.stdout and "== Configuration groups ==" in proc.stdout
    assert "model: gemma2_2b" in proc.stdout and "target_modules:" in proc.stdout  # every option and every key


def test_train_plans_a_lora_on_the_head(tmp_path):
    """A target the build takes is one the memory estimate counts: --plan estimates it (no GPU needed)."""
    argv = ["-m", "hardware=gpu", "model=gemma_2b", "lora.target_modules=[q_proj,v_proj,lm_head]", "--plan"]
    proc = subprocess.run([sys.executable, "-m", "exp.train", *argv], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "study plan: 1 job(s), 1 to run, 0 reused, 0 failing their config checks" in proc.stdout, proc.stdout
    job = next(line for line in proc.stdout.splitlines() if line.startswith("0_hardware=gpu,lora.target_modules"))
    assert float(job.split()[1]) > 0  # the estimate, GiB
    assert not list(tmp_path.iterdir())  # nothing was started or written


@pytest.mark.parametrize("module", TOOLS)
def test_an_option_flag_is_refused_in_one_paragraph(module, capsys):
    assert exit_status(module, ["--no-such-thing", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"exp: error: {module}: unknown option '--no-such-thing'. exp's tools take key=value")
    assert f"python -m {module} --help" in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("exp.merge", ["--out", "merged"], "unknown option '--out'. exp's tools take key=value arguments, not "
         "--options: write out=merged"),
        ("exp.preview", ["--max-steps", "5"], "write trainer.max_steps=5"),
        ("exp.bench", ["--micro-batch", "8"], "write micro_batch=8"),
        ("exp.evaluate", ["btach_size=4"], "unknown key 'btach_size' (in 'btach_size=4'). Did you mean batch_size=...?"),
        ("exp.generate", ["max_new_tokens=many"], "max_new_tokens=many: expected an integer"),
        ("exp.generate", ["template=html"], "template=html: not one of alpaca, chat. Fix: e.g. template=alpaca"),
        ("exp.report", [], "exp.report: name a sweep directory or run directories"),
        ("exp.report", ["missing"], "no such directory: missing"),
        ("exp.doctor", ["lora"], "argument 'lora' is not key=value"),
        ("exp.merge", ["data.max_seq_len=8"], "unknown key 'data.max_seq_len'"),  # merge's data is the run's
    ],
)  # fmt: skip
def test_a_bad_argument_names_itself_and_the_fix(module, argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # exp.report's bare word is a directory: none here
    assert exit_status(module, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("exp: error:") and message in err, err


def test_verbose_flag_is_the_verbose_key():
    from exp.core.cli import parse
    from exp.generate import TOOL as GENERATE
    from exp.preview import TOOL as PREVIEW
    from exp.run.compose import compose_config

    assert parse(PREVIEW, ["-v", "n=1"]).passed == ["verbose=true"]
    assert parse(GENERATE, ["--verbose"]).values["verbose"] is True
    assert compose_config(["verbose=true"]).verbose and not compose_config([]).verbose


def test_train_refuses_an_option_flag_with_exit_status_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", "--max-steps", "5", "lora"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("exp: error: exp.train: unknown option '--max-steps'")
    assert "write trainer.max_steps=5" in proc.stderr and "argument 'lora' is not key=value" in proc.stderr
    assert "argument '5'" not in proc.stderr  # the flag's value is part of the flag's message
    assert not (tmp_path / "outputs").exists()
