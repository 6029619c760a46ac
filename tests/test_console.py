"""What the tools print: exp.evaluate, exp.generate and exp.merge start with exp.train's quiet console, and a
progress bar written to a file is redrawn rarely, not once per refresh."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys

import pytest

from exp.run import logs
from exp.run.logs import FILE_REFRESH_S, StepProgressBar

NOISE = ("kernels-community", "Loading weights", "FutureWarning", "dequantized in")


@pytest.fixture
def loud_third_party():
    """transformers' bars on and bitsandbytes at WARNING, as a fresh interpreter has them; restored after."""
    from transformers.utils import logging as hf_logging

    bnb = logging.getLogger("bitsandbytes")
    level = bnb.level
    hf_logging.enable_progress_bar()
    bnb.setLevel(logging.WARNING)
    yield hf_logging
    hf_logging.enable_progress_bar()
    bnb.setLevel(level)


@pytest.mark.parametrize("module", ["exp.evaluate", "exp.generate", "exp.merge"])
def test_inference_tools_quiet_third_party_logs_before_their_work(module, loud_third_party, tmp_path, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main([f"run={tmp_path / 'missing'}", "out=" + str(tmp_path / "out")] if module == "exp.merge" else [])
    assert e.value.code == 2, capsys.readouterr().err
    assert not loud_third_party.is_progress_bar_enabled()  # no "Loading weights" bar per model load
    assert logging.getLogger("bitsandbytes").getEffectiveLevel() == logging.ERROR  # no kernels-hub notice


def test_verbose_keeps_the_third_party_output(loud_third_party, tmp_path, capsys):
    from exp.evaluate import main

    with pytest.raises(SystemExit):
        main([f"run={tmp_path / 'missing'}", "-v"])
    assert loud_third_party.is_progress_bar_enabled()


def test_a_bar_written_to_a_file_redraws_every_few_seconds_and_at_its_end(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    bar = StepProgressBar(refresh_rate=1)
    drawn = []
    for step in range(1, 101):  # 100 steps, one second each
        clock[0] += 1.0
        if bar._should_update(step, 100):
            drawn.append(step)
    assert drawn == [*range(1, 100, int(FILE_REFRESH_S)), 100]  # not 100 redraws: one per FILE_REFRESH_S, the end
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert all(bar._should_update(step, 100) for step in range(1, 101))  # a terminal: every refresh_rate steps


def test_generate_to_a_file_prints_the_answer_only(short_run, tmp_path):
    """The CLI's own output, redirected as a job script would: no bars, notices or deprecation warnings."""
    log = tmp_path / "generate.log"
    with log.open("w") as out:
        args = [f"run={short_run.output_dir}", "prompt=Repeat the words exactly.", "input=red fox", "max_new_tokens=4"]
        subprocess.run([sys.executable, "-m", "exp.generate", *args], stdout=out, stderr=out, timeout=300, check=True)
    text = log.read_text()
    assert not [n for n in NOISE if n in text], text
    assert "\r" not in text, text
