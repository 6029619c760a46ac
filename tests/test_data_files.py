"""Data files that are not what the readers expect: every one is refused with the file, the place in it (line, byte)
and the fix, never with a decoding traceback; files that are fine but written differently (a byte-order mark, blank
lines) are read."""

from __future__ import annotations

import codecs
import csv
import io
import json
import logging
import os
from pathlib import Path

import pytest
from conftest import compose_typed

from exp.core.config import ConfigError
from exp.data.files import CHUNK
from exp.data.formats import format_prompt
from exp.data.splits import all_examples
from exp.model.build import build_tokenizer

ROWS = [{"instruction": f"Say {i}", "input": "", "output": f"{i} é"} for i in range(20)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(compose_typed([]).model)


def read(path: Path, tokenizer) -> list:
    """The usable rows of an Alpaca file at data.path, read and encoded as training reads them (in file order)."""
    return all_examples(compose_typed(["data=alpaca", f"data.path={path}"]).data, tokenizer)


def jsonl(rows=ROWS) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def csv_text(rows=ROWS, header=("instruction", "input", "output")) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(header))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def replace_line(text: str, number: int, line: str) -> str:
    lines = text.splitlines()
    lines[number - 1] = line
    return "\n".join(lines) + "\n"


# name, what to write at data.path (bytes for a file, a dict of name -> bytes for a directory), what the message
# must say.
BAD = [
    ("utf16-jsonl", {"d.jsonl": jsonl().encode("utf-16")}, "is UTF-16 text", "iconv -f UTF-16 -t UTF-8"),
    ("utf32-jsonl", {"d.jsonl": jsonl().encode("utf-32")}, "is UTF-32 text", "iconv -f UTF-32"),
    ("latin1-csv", {"d.csv": csv_text().encode("latin-1")}, "is not UTF-8: line 2 (byte 35)", "iconv -f latin1"),
    ("cp1252-jsonl", {"d.jsonl": jsonl().encode("cp1252")}, "is not UTF-8: line 1", "Save the file as UTF-8"),
    (
        "binary-jsonl",
        {"d.jsonl": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" * 50},
        "holds binary data (a NUL byte on line 3, byte 8)",
        "",
    ),
    ("utf16-without-bom", {"d.csv": csv_text().encode("utf-16-le")}, "holds binary data (a NUL byte on line 1", ""),
    ("truncated-utf8", {"d.jsonl": jsonl().encode()[:-4]}, "ends in the middle of a character", "Save it again"),
    (
        "bad-jsonl-line",
        {"d.jsonl": replace_line(jsonl(), 8, '{"instruction": "x", "output": ').encode()},
        "d.jsonl: line 8 is not valid JSON",
        "one JSON object per line",
    ),
    ("jsonl-line-a-list", {"d.jsonl": replace_line(jsonl(), 6, "[1, 2]").encode()}, "line 6 is a list", "an object"),
    (
        "json-array-truncated",
        {"d.json": json.dumps(ROWS, indent=1)[:-30].encode()},
        "it ends in the middle of a record (line 99, column",
        "looks truncated, a copy cut short",
    ),
    (
        "jsonl-truncated",
        {"d.jsonl": jsonl().encode()[:-25]},
        "it ends in the middle of a record (line 20, column",
        "Copy it again from its source, after checking the free space",
    ),
    ("json-array-broken", {"d.json": json.dumps(ROWS, indent=1)[:-2].encode() + b"}}]"}, "not valid JSON: line", ""),
    (
        "csv-row-too-long",
        {"d.csv": replace_line(csv_text(), 5, "a,b,c,d").encode()},
        "line 5 has 4 fields, the header 3",
        "quote fields",
    ),
    (
        "csv-truncated",
        {"d.csv": csv_text().encode() + b'"one more","","an answer cut sh'},
        "it ends in the middle of a record (line",
        "a quoted field is still open at the end of the file): the file looks truncated",
    ),
    ("not-parquet", {"d.parquet": b"a,b\n1,2\n"}, "is not a Parquet file", "magic bytes"),
    (
        "mixed-columns-jsonl",
        {"a.jsonl": jsonl().encode(), "b.jsonl": jsonl([{"prompt": "p", "completion": "c"}] * 3).encode()},
        "the files have different columns (a.jsonl: instruction, input, output; b.jsonl: prompt, completion)",
        "point data.path at one file",
    ),
    (
        "mixed-columns-csv",
        {"a.csv": csv_text().encode(), "b.csv": b"prompt,completion\np,c\n"},
        "the files have different columns",
        "keep files with the same columns together",
    ),
    (
        "one-json-object",
        {"d.json": json.dumps({"data": ROWS}, indent=2).encode()},
        "holds one JSON object, not rows (the rows may be its 'data' list",
        "a JSON array of objects, or JSONL",
    ),
    ("all-empty", {"a.jsonl": b"", "b.jsonl": b"\n  \n"}, "the data is empty (a.jsonl, b.jsonl)", "point data.path"),
    ("mixed-types", {"a.jsonl": jsonl().encode(), "b.csv": csv_text().encode()}, "mixes file types", "one type"),
]


def write(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root if len(files) > 1 else root / next(iter(files))


@pytest.mark.parametrize(("files", "message", "fix"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_bad_data_file_is_named_with_the_place_and_the_fix(tmp_path, tokenizer, files, message: str, fix: str):
    path = write(tmp_path / "data", files)
    with pytest.raises(ConfigError) as info:
        read(path, tokenizer)
    text = str(info.value)
    assert text.startswith("data.path") and message in text and fix in text, text
    if path.is_file():
        assert str(path) in text


def test_a_file_cut_anywhere_in_its_last_record_is_said_to_be_truncated(tmp_path):
    """Wherever a copy stops inside the last record (a string, a number, between a key and its value, before the
    closing bracket), the file is said to be truncated; damage with more of the file after it is not."""
    from exp.data.files import diagnose

    for name, text in {"d.json": json.dumps(ROWS, indent=1), "d.jsonl": jsonl()}.items():
        path = tmp_path / name
        for cut in range(text.rstrip().rfind("{") + 1, len(text.rstrip())):
            path.write_text(text[:cut])
            problem = diagnose([path], "data.path")
            assert problem and "looks truncated" in problem and f"df -h {tmp_path}" in problem, (
                text[:cut][-30:],
                problem,
            )
    damaged = replace_line(jsonl(), 8, '{"instruction": "x", "output": ')  # the same cut, but lines follow it
    (tmp_path / "d.jsonl").write_text(damaged)
    assert "line 8 is not valid JSON" in diagnose([tmp_path / "d.jsonl"], "data.path")


GOOD = [
    ("utf8-bom-jsonl", {"d.jsonl": codecs.BOM_UTF8 + jsonl().encode()}),
    ("utf8-bom-csv", {"d.csv": codecs.BOM_UTF8 + csv_text().encode()}),
    ("blank-lines", {"d.jsonl": jsonl().replace("\n", "\n\n").encode()}),
    ("hidden-file-skipped", {"d.jsonl": jsonl().encode(), "._d.jsonl": b"\0\x05\x16\x07binary metadata"}),
    ("one-empty-file", {"a.jsonl": jsonl().encode(), "b.jsonl": b""}),
    ("non-ascii", {"d.jsonl": jsonl([{**r, "output": "日本語 ✓"} for r in ROWS]).encode()}),
]


@pytest.mark.parametrize("files", [c[1] for c in GOOD], ids=[c[0] for c in GOOD])
def test_files_written_differently_are_read(tmp_path, tokenizer, files):
    path = write(tmp_path / "data", files)
    rows = read(path, tokenizer)
    assert len(rows) == 20
    assert tokenizer.decode(rows[0].input_ids, skip_special_tokens=True).startswith(format_prompt("Say 0", ""))


def test_the_check_streams_and_counts_lines_across_chunks(tmp_path, tokenizer):
    """A bad byte far past the first chunk is found with its line number (the file is read in chunks, once)."""
    line = json.dumps(ROWS[0]) + "\n"
    lines = CHUNK // len(line) * 3
    path = tmp_path / "big.jsonl"
    path.write_bytes((line * lines).encode() + b'{"instruction": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=rf"line {lines + 1} \(byte {len(line) * lines + 20}\)"):
        read(path, tokenizer)


def test_a_damaged_datasets_cache_entry_is_rebuilt(tmp_path, tokenizer, monkeypatch, caplog):
    monkeypatch.setenv("EXP_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "d.jsonl"
    path.write_text(jsonl())
    assert len(read(path, tokenizer)) == 20
    (arrow,) = (tmp_path / "cache" / "datasets").rglob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:100])  # truncated by a full disk, say
    with caplog.at_level(logging.WARNING, logger="exp.data.sources"):
        assert len(read(path, tokenizer)) == 20
    assert "the files are sound; rebuilt its datasets cache entry" in caplog.text


def test_the_diagnosis_names_a_type_change_by_line(tmp_path):
    """What `datasets` reports as 'changed from string to object in row 0' (no file, no line)."""
    from exp.data.files import diagnose

    path = tmp_path / "d.jsonl"
    path.write_text(replace_line(jsonl(), 4, json.dumps({"instruction": {"a": 1}, "input": "", "output": "x"})))
    assert diagnose([path], "data.path") == (
        f"data.path: {path}: line 4: column 'instruction' is an object, where earlier rows have a string; a column "
        "holds one type (text fields: strings)"
    )


def test_a_pipe_named_as_data_is_refused_not_read_forever(tmp_path, tokenizer):
    fifo = tmp_path / "d.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"not a regular file or a directory \(a pipe, a socket or a device\)"):
        read(fifo, tokenizer)


@pytest.mark.parametrize("name", ["set[1].jsonl", "a*b?.jsonl", "[x].json"])
def test_file_names_with_glob_characters_are_literal(tmp_path, name):
    """`datasets` reads data_files as glob patterns; exp's checked paths are literal names."""
    from exp.data.sources import _read_files

    rows = [{"instruction": f"say {i}", "input": "", "output": f"number {i}"} for i in range(5)]
    path = tmp_path / name
    text = json.dumps(rows) if name.endswith(".json") else "\n".join(json.dumps(r) for r in rows)
    path.write_text(text)
    (tmp_path / "set1.jsonl").write_text(json.dumps(rows[0]))  # what `set[1]` would match as a pattern
    ds = _read_files([path], str(path), "data.path")
    assert len(ds) == 5 and ds[4]["output"] == "number 4"


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("data.path=alpaca_dmo.jsonl", "no such file or directory. Did you mean data.path=alpaca_demo.jsonl?"),
        ("data.path=columns.jsonl", "no column 'instruction', 'output' (needed by data.format=alpaca)"),
    ],
)
def test_a_data_path_or_column_mistake_is_refused_before_torch_loads(arg, message, tmp_path):
    """Checked with the command line, before Hydra starts: `-X importtime` lists every module imported by then."""
    import subprocess
    import sys

    (tmp_path / "alpaca_demo.jsonl").write_text('{"instruction": "a", "input": "", "output": "b"}\n')
    (tmp_path / "columns.jsonl").write_text('{"question": "a", "answer": "b"}\n')
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "exp.train", "data=alpaca", arg],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported and "torch" not in imported and "datasets" not in imported
    assert not (tmp_path / "outputs").exists()


def test_a_missing_file_names_the_nearest_file_of_its_directory(tmp_path):
    from exp.data.files import missing_path

    (tmp_path / "train_set.jsonl").write_text("{}\n")
    text = missing_path(str(tmp_path / "trian_set.jsonl"), "data.path", tmp_path / "trian_set.jsonl")
    assert f"Did you mean data.path={tmp_path / 'train_set.jsonl'}?" in text
    assert "Did you mean" not in missing_path("zzz.csv", "data.path", tmp_path / "zzz.csv")
