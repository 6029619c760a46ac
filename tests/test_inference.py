"""After training: evaluate, generate, merge (with its parity proof) and the errors of bad input, on the tiny run."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import Together, compose_typed

from exp.core.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)


def in_process(main, args: list[str], capsys) -> tuple[int, str]:
    """A command's main() as the CLI runs it: (exit status, stderr)."""
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def loaded(short_run):
    from exp.run.inference import load_run

    return load_run(short_run.output_dir)


@pytest.fixture(scope="module")
def merged(short_run, tmp_path_factory):
    from exp.merge import merge

    out = tmp_path_factory.mktemp("merged") / "model"
    return out, merge([f"run={short_run.output_dir}", f"out={out}"])


def test_evaluate_reproduces_the_runs_final_validation(short_run):
    from exp.evaluate import evaluate

    report = evaluate([f"run={short_run.output_dir}"])
    final = json.loads((short_run.output_dir / "summary.json").read_text())["final_val"]
    assert report["loss"] == pytest.approx(final["val/loss"], abs=1e-4)
    assert report["token_accuracy"] == pytest.approx(final["val/token_accuracy"], abs=1e-4)
    assert report["exact_match"] == pytest.approx(final["val/exact_match"], abs=1e-4)
    assert report["perplexity"] == pytest.approx(torch.tensor(report["loss"]).exp().item(), rel=1e-6)
    assert report["examples"] == 40  # 10% of data.num_examples=400
    assert json.loads((short_run.output_dir / "eval.json").read_text())["loss"] == report["loss"]


def test_evaluate_checkpoint_gives_the_adapters_numbers(short_run):
    from exp.evaluate import evaluate

    ckpts = short_run.output_dir / "checkpoints"
    last = evaluate([f"ckpt={ckpts / 'last.ckpt'}"])
    adapter = json.loads((short_run.output_dir / "eval.json").read_text())
    assert last["loss"] == pytest.approx(adapter["loss"], abs=1e-6)
    assert (short_run.output_dir / "eval_last.json").exists()  # eval.json keeps the adapter's numbers
    # The step-15 checkpoint really replaces the adapter weights: a different (higher) loss.
    mid = evaluate([f"ckpt={ckpts / 'step-000015.ckpt'}"])
    assert mid["loss"] > last["loss"] + 1e-3


def test_greedy_generation_is_a_manual_greedy_decode(loaded):
    from exp.generate import GenerationOptions, generate_ids, prompt_ids

    prompt, words = "Repeat the words exactly.", "red fox owl cat"
    opts = GenerationOptions(max_new_tokens=10)
    got = generate_ids(loaded, prompt, words, opts)
    assert got == generate_ids(loaded, prompt, words, opts), "greedy decoding is deterministic"
    ids = torch.tensor([prompt_ids(loaded.tokenizer, prompt, words, "alpaca")])
    manual = []
    with torch.no_grad():  # no cache, the whole sequence each time: the definition of greedy decoding
        for _ in range(10):
            nxt = int(loaded.model(input_ids=ids).logits[0, -1].argmax())
            if nxt == loaded.tokenizer.eos_token_id:
                break
            manual.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert got == manual
    # The Alpaca prompt is the training encoding: <bos> once, then the template.
    from conftest import encode

    enc, _ = encode(loaded.tokenizer, {"instruction": prompt, "input": words, "output": "x"})
    first_label = next(i for i, t in enumerate(enc.labels) if t != -100)
    assert prompt_ids(loaded.tokenizer, prompt, words, "alpaca") == enc.input_ids[:first_label]


def test_sampling_is_reproducible_with_a_seed_and_chat_template_has_one_bos(loaded):
    from exp.generate import GenerationOptions, generate_ids, prompt_ids

    opts = GenerationOptions(max_new_tokens=12, do_sample=True, temperature=1.0, top_p=0.9, seed=7)
    a = generate_ids(loaded, "Repeat the words exactly.", "sun moon", opts)
    assert a == generate_ids(loaded, "Repeat the words exactly.", "sun moon", opts)
    chat = prompt_ids(loaded.tokenizer, "hi", "", "chat")
    assert chat.count(loaded.tokenizer.bos_token_id) == 1 and chat[0] == loaded.tokenizer.bos_token_id
    assert loaded.tokenizer.decode(chat).endswith("<start_of_turn>model\n")
    with pytest.raises(ConfigError, match="template=jinja"):
        GenerationOptions(template="jinja")


def test_generate_command_streams_the_greedy_answer(short_run, loaded, capsys):
    from exp.generate import generate_text, main

    expected = generate_text(loaded, "Repeat the words exactly.", "red fox")
    capsys.readouterr()
    main([f"run={short_run.output_dir}", "prompt=Repeat the words exactly.", "input=red fox"])  # exits 0: returns
    assert capsys.readouterr().out.strip() == expected.strip()


def test_merged_checkpoint_loads_with_plain_transformers_and_matches(short_run, merged, loaded, tmp_path):
    out, report = merged
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    parity = json.loads((out / "parity.json").read_text())
    assert parity == json.loads(json.dumps(report))
    assert parity["ok"] and parity["tied_embeddings"].startswith("tied")
    q = parity["quantized_vs_merged"]
    assert {"kl_mean", "perplexity_reference", "perplexity_other"} <= q.keys()
    # base=dequantized: the merged model computes what the 4-bit model + adapter computed.
    assert q["kl_mean"] < 1e-6 and q["top1_agreement"] == 1.0
    assert parity["merge"]["max_abs_logit_diff_vs_unmerged"] < 1e-4

    # Plain transformers in a fresh interpreter: no exp, PEFT or bitsandbytes import.
    ids = torch.tensor([[2, 40, 41, 42, 43, 44, 45, 46, 47, 48]])
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
        "assert m.get_output_embeddings().weight is m.get_input_embeddings().weight\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        f"torch.save(m(input_ids=ids).logits.detach(), {str(tmp_path / 'logits.pt')!r})\n"
        "assert not any(k == 'exp' or k.startswith(('exp.', 'peft', 'bitsandbytes')) for k in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plain = torch.load(tmp_path / "logits.pt")

    # The reference: the same dequantized base with the adapter unmerged (LoRA applied at every forward).
    from exp.run.inference import load_adapter, load_base, run_config

    cfg = run_config(short_run.output_dir, torch.device("cpu"))
    base = load_base(cfg, short_run.output_dir, torch.device("cpu")).dequantize(dtype=torch.float32)
    unmerged = load_adapter(base, short_run.output_dir / "adapter")
    with torch.no_grad():
        ref = unmerged(input_ids=ids).logits
        quantized = loaded.model(input_ids=ids).logits
    torch.testing.assert_close(plain, ref, atol=1e-4, rtol=0)
    # vs the 4-bit model + adapter: the 4-bit kernel dequantizes block by block; 1e-3 covers its round-off.
    torch.testing.assert_close(plain, quantized, atol=1e-3, rtol=0)


def test_merge_into_the_original_weights_reports_the_quantization_gap(short_run, tmp_path):
    from exp.merge import merge

    report = merge([f"run={short_run.output_dir}", f"out={tmp_path / 'orig'}", "base=original", "examples=8"])
    assert report["ok"] and report["merge"]["max_abs_logit_diff_vs_unmerged"] < 1e-4
    # The adapter learned against the 4-bit weights: against the original ones the answers drift measurably.
    assert report["quantized_vs_merged"]["kl_mean"] > 1e-4


def copy_run(run_dir: Path, dest: Path, adapter: bool = True) -> Path:
    dest.mkdir(parents=True)
    shutil.copy(run_dir / "config.yaml", dest / "config.yaml")
    if adapter:
        shutil.copytree(run_dir / "adapter", dest / "adapter")
    return dest


def merge_into_a_taken_dir(run_dir: Path, root: Path):
    out = root / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    return out, cli("exp.merge", f"run={run_dir}", f"out={out}")


def evaluate_without_adapter(run_dir: Path, root: Path) -> subprocess.CompletedProcess:
    return cli("exp.evaluate", f"run={copy_run(run_dir, root / 'noadapter', adapter=False)}")


@pytest.fixture(scope="module")
def refusals(request, short_run, tmp_path_factory) -> Together:
    """The command lines refused here (each seconds of imports in a process of its own), side by side."""
    steps = {
        "merge": partial(merge_into_a_taken_dir, short_run.output_dir, tmp_path_factory.mktemp("merge")),
        "no-adapter": partial(evaluate_without_adapter, short_run.output_dir, tmp_path_factory.mktemp("evaluate")),
    }
    uses = {
        "merge": ["test_merge_refuses_a_non_empty_out_dir_with_or_without_overwrite"],
        "no-adapter": ["test_run_dir_without_adapter_fails_clearly"],
    }
    with Together(request, steps, uses) as together:
        yield together


def files_of(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file below `root`: its bytes and modification time (what "nothing was touched" compares)."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_merge_refuses_a_non_empty_out_dir_with_or_without_overwrite(short_run, refusals, capsys):
    """A directory exp.merge did not write is never replaced: overwrite=true is for an earlier merge output only."""
    out, r = refusals.get("merge")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "exp: error:" in r.stderr and "not empty" in r.stderr and "keep.txt" in r.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"

    from exp.merge import main

    code, err = in_process(main, [f"run={short_run.output_dir}", f"out={out}", "overwrite=true"], capsys)
    assert code == 2 and "not an earlier output of exp.merge" in err and f"out={out.parent / 'taken_merged'}" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in out.parent.iterdir()) == ["taken"]  # no partial checkpoint left beside it


@pytest.mark.parametrize("overwrite", [[], ["overwrite=true"]], ids=["plain", "overwrite"])
def test_merge_never_writes_over_a_training_run(short_run, tmp_path, overwrite, capsys):
    """out= the run being merged, or another run: refused before anything loads, every file of the run unchanged."""
    from exp.merge import main

    other = copy_run(short_run.output_dir, tmp_path / "other")
    (other / "status.json").write_text('{"status": "completed"}')
    for out in (short_run.output_dir, other):
        before = files_of(out)
        code, err = in_process(main, [f"run={short_run.output_dir}", f"out={out}", *overwrite], capsys)
        assert code == 2 and "holds a training run" in err and "never writes over a run" in err, err
        assert f"out={out.parent / (out.name + '_merged')}" in err and "Traceback" not in err
        assert files_of(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_merge_overwrite_replaces_an_earlier_merge_output_in_one_step(short_run, merged, tmp_path, capsys):
    from exp.merge import MERGE_MARKER, main

    out = shutil.copytree(merged[0], tmp_path / "model")
    assert (out / MERGE_MARKER).is_file()
    (out / "stale.txt").write_text("from the earlier merge")
    code, err = in_process(main, [f"run={short_run.output_dir}", f"out={out}", "examples=2"], capsys)
    assert code == 2 and "holds an earlier merged checkpoint" in err and "overwrite=true" in err
    assert (out / "stale.txt").exists()

    code, err = in_process(main, [f"run={short_run.output_dir}", f"out={out}", "overwrite=true", "examples=2"], capsys)
    assert code == 0, err
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert json.loads((out / "parity.json").read_text())["examples"] == 2  # the new checkpoint's own report
    assert json.loads((out / MERGE_MARKER).read_text())["run"] == str(short_run.output_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no partial or replaced copy left beside it


def merge_output(path: Path, name: str = "weights") -> Path:
    from exp.merge import MERGE_MARKER

    path.mkdir(parents=True)
    (path / MERGE_MARKER).write_text("{}")
    (path / name).write_text(name)
    return path


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "moved-aside"])
def test_a_merge_output_is_installed_whole_and_only_over_its_own_kind(tmp_path, monkeypatch, exchange):
    """`install`: onto a new or empty directory, or over an earlier merge output (swapped in one rename where the
    system can, else moved aside first); anything else at `out` by then stops it, the new checkpoint kept."""
    import exp.merge
    from exp.merge import MERGE_MARKER, check_out_dir, install

    if not exchange:
        monkeypatch.setattr(exp.merge, "_exchange", lambda a, b: False)
    out = merge_output(tmp_path / "out", "old")
    install(merge_output(tmp_path / ".out.1.partial", "new"), out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["exp_merge.json", "new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    (tmp_path / "empty").mkdir()
    install(merge_output(tmp_path / ".empty.1.partial"), tmp_path / "empty", overwrite=False)
    assert (tmp_path / "empty" / "weights").exists()

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "status.json").write_text('{"status": "completed"}')
    (run / MERGE_MARKER).write_text("{}")  # a marker does not make a run replaceable
    partial = merge_output(tmp_path / ".run.1.partial")
    with pytest.raises(ConfigError, match=f"holds a training run .*kept in {partial}"):
        install(partial, run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "exp_merge.json", "status.json"]
    with pytest.raises(ConfigError, match="exists and is a file"):
        check_out_dir(str(run / "status.json"), overwrite=True)
    assert check_out_dir(str(tmp_path / "new"), overwrite=False) == tmp_path / "new"


def test_run_dir_without_adapter_fails_clearly(refusals):
    r = refusals.get("no-adapter")
    assert r.returncode == 2
    assert "no adapter" in r.stderr and "adapter_model.safetensors" in r.stderr and "completed run" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_missing_run_dir_fails_clearly(tmp_path):
    r = cli("exp.generate", f"run={tmp_path / 'nope'}", "prompt=hi")
    assert r.returncode == 2
    assert "no such directory" in r.stderr and "Traceback" not in r.stderr


def test_adapter_for_another_architecture_fails_clearly(short_run, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    run = copy_run(short_run.output_dir, tmp_path / "foreign")
    weights = run / "adapter" / "adapter_model.safetensors"
    # An adapter trained on a model of hidden size 64: LoRA A maps 64 -> r, B maps r -> 64-ish.
    tensors = {k: torch.zeros(v.shape[0], 64) if "lora_A" in k else v for k, v in load_file(weights).items()}
    save_file(tensors, weights)
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/models/other-gemma-h64"
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(config))

    from exp.evaluate import main

    code, err = in_process(main, [f"run={run}"], capsys)
    assert code == 2
    assert "does not fit this base model" in err and "/models/other-gemma-h64" in err and "size mismatch" in err


def test_missing_base_model_fails_clearly(short_run, tmp_path, capsys):
    run = copy_run(short_run.output_dir, tmp_path / "movedbase")
    text = (run / "config.yaml").read_text().replace("path: null", f"path: {tmp_path / 'gone'}", 1)
    (run / "config.yaml").write_text(text)

    from exp.merge import main

    code, err = in_process(main, [f"run={run}", f"out={tmp_path / 'm'}"], capsys)
    assert code == 2
    assert "base model of run" in err and "no config.json" in err and "model.path=<dir>" in err
    assert not (tmp_path / "m").exists()


def test_bad_arguments_name_the_key(short_run, capsys):
    from exp.generate import main

    code, err = in_process(main, [f"run={short_run.output_dir}", "promt=hi"], capsys)
    assert code == 2 and "unknown key 'promt'" in err and "Did you mean prompt=" in err
    code, err = in_process(main, [f"run={short_run.output_dir}", "prompt=hi", "max_new_tokens=many"], capsys)
    assert code == 2 and "max_new_tokens=many" in err


def test_lm_eval_without_the_package_says_how_to_install(short_run, capsys):
    import importlib.util

    if importlib.util.find_spec("lm_eval") is not None:
        pytest.skip("lm_eval is installed")
    from exp.evaluate import main

    code, err = in_process(main, [f"run={short_run.output_dir}", "lm_eval=hellaswag", "name=lm"], capsys)
    assert code == 2 and "pip install lm-eval" in err


def test_samples_at_the_step_0_validation_only_when_asked(tmp_path):
    """The step-0 validation (Lightning's sanity check) answers the prompts only with trainer.sample_at_start: the
    untrained adapters answer as the base model does, and would decode every sample_max_new_tokens token."""
    from types import SimpleNamespace

    from exp.training.samples import SampleGenerations

    answered = []
    for at_start in (False, True):
        cfg = compose_typed([f"trainer.sample_at_start={str(at_start).lower()}"])
        callback = SampleGenerations(cfg, tmp_path / f"samples-{at_start}.txt")
        callback.prompts, callback.tokenizer = [[2, 5, 6]], SimpleNamespace(decode=lambda ids, **_: "p")
        callback._greedy = lambda model, prompts, device: ["an answer"] * len(prompts)
        for sanity, step in ((True, 0), (False, 15)):
            trainer = SimpleNamespace(is_global_zero=True, sanity_checking=sanity, global_step=step, loggers=[])
            module = SimpleNamespace(model=torch.nn.Linear(1, 1), device=torch.device("cpu"))
            callback.on_validation_epoch_end(trainer, module)
        text = callback.path.read_text()
        answered.append([int(line.split()[2]) for line in text.splitlines() if line.startswith("=== step")])
    assert answered == [[15], [0, 15]]


def test_training_writes_samples_at_every_validation(short_run, loaded):
    text = (short_run.output_dir / "samples.txt").read_text()
    steps = [int(line.split()[2]) for line in text.splitlines() if line.startswith("=== step")]
    # Not at step 0 (trainer.sample_at_start); the final validation repeats step 30 and is not written twice.
    assert steps == [15, 30]
    assert text.count("[3] prompt: '### Instruction:\\nRepeat the words exactly.") == 2
    assert text.count("    answer: ") == 6
    # Prompts are written exactly: a copied one, after <bos>, is the held-out example's prompt token for token.
    from exp.training.samples import prompt_ids_from_heldout

    tokenizer = loaded.tokenizer
    written = [ast.literal_eval(line.split("prompt: ", 1)[1]) for line in text.splitlines() if "] prompt: " in line]
    assert all(p.endswith("### Response:\n") for p in written)
    heldout = prompt_ids_from_heldout(build_datamodule(short_run.module.cfg, tokenizer), 3)
    copied = [[tokenizer.bos_token_id, *tokenizer(p, add_special_tokens=False)["input_ids"]] for p in written[-3:]]
    assert copied == heldout


def test_samples_batched_greedy_answers_equal_one_prompt_at_a_time():
    """The samples' one left-padded generate call gives each prompt the answer it gets alone (untrained adapters:
    the answers run the whole sample length)."""
    from conftest import compose_typed

    from exp.generate import prompt_ids
    from exp.model.build import build_model, build_tokenizer
    from exp.training.samples import SampleGenerations

    cfg = compose_typed(["logger=none", "trainer.sample_max_new_tokens=12"])
    model, tokenizer = build_model(cfg, "cpu").eval(), build_tokenizer(cfg.model)
    sampler = SampleGenerations(cfg, Path("unused"))
    sampler.tokenizer = tokenizer
    words = ["river stone", "seven blue quick model answer light paper green under", "over"]
    prompts = [prompt_ids(tokenizer, "Repeat the words exactly.", w, "alpaca") for w in words]
    assert len({len(p) for p in prompts}) == 3  # different lengths: the batch pads two of them
    with torch.no_grad():
        together = sampler._greedy(model, prompts, torch.device("cpu"))
        alone = [sampler._greedy(model, [p], torch.device("cpu"))[0] for p in prompts]
    assert together == alone and all(together)


def build_datamodule(cfg, tokenizer):
    from exp.data.datamodule import build_datamodule as build

    return build(cfg.data, tokenizer, cfg.hardware.micro_batch_size, cfg.hardware.num_workers)


def doc_block(path: Path, heading: str, lang: str = "python") -> str:
    """The first ```lang block after `heading` in a Markdown file."""
    text = path.read_text()
    after = text[text.index(heading) :]
    start = after.index(f"```{lang}\n") + len(f"```{lang}\n")
    return after[start : after.index("```", start)]


def test_the_documented_peft_snippet_answers_as_exp_generate(short_run, loaded):
    """docs/after-training.md's transformers + PEFT block, run as written (only the run directory filled in), gives
    exp.generate's greedy answer to its prompt."""
    from exp.generate import GenerationOptions, generate_text

    code = doc_block(ROOT / "docs" / "after-training.md", "## Without exp")
    placeholder = re.search(r'^run = Path\("[^"]*"\)', code, re.M)
    assert placeholder, "the snippet names its run directory on one line: run = Path(...)"
    code = code.replace(placeholder.group(0), f"run = Path({str(short_run.output_dir)!r})")
    assert "import exp" not in code and "from exp" not in code
    namespace: dict = {}
    exec(compile(code, "docs/after-training.md", "exec"), namespace)
    prompt = namespace["prompt"]
    assert prompt == "### Instruction:\nRepeat the words exactly.\n\n### Input:\nred fox owl\n\n### Response:\n"
    expected = generate_text(loaded, "Repeat the words exactly.", "red fox owl", GenerationOptions(max_new_tokens=64))
    assert namespace["answer"] == expected
    # The same tokens as exp's prompt, into the same model: logits equal to float round-off, so the answers agree
    # for any prompt, not only this one.
    from exp.generate import prompt_ids

    ids = namespace["ids"]
    assert ids[0].tolist() == prompt_ids(loaded.tokenizer, "Repeat the words exactly.", "red fox owl", "alpaca")
    with torch.no_grad():
        theirs, ours = namespace["model"](input_ids=ids).logits, loaded.model(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert namespace["base_path"] == str(loaded.model.base_model.model.config.name_or_path)
