"""exp.bench and the loss levers: the harness end to end on the CPU (a smoke test of the harness, not a speed
claim), exp's chunked loss against transformers' loss, and where each loss implementation is chosen."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, Together, compose_typed, encode

from exp.core.config import ConfigError, LossImpl
from exp.core.constants import IGNORE_INDEX
from exp.core.strategies import Strategy
from exp.data.batching import collate
from exp.data.synthetic import generate_examples
from exp.model.build import build_model, build_tokenizer
from exp.model.loss import causal_lm_loss, chunked_linear_cross_entropy, resolve_loss_impl
from exp.model.metrics import (
    add_sums,
    batch_response_metrics,
    chunked_response_metrics,
    response_metrics,
    validation_rates,
)
from exp.training.module import build_optimizer

SMOKE = ["model=gemma_tiny", "seq=64", "micro_batch=2", "steps=5", "warmup=2"]


def run_bench(out_dir, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "exp.bench", *args, f"out_dir={out_dir}"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)


def read_report(out_dir) -> tuple[dict, str]:
    [path] = out_dir.glob("bench-*.json")
    return json.loads(path.read_text()), path.with_suffix(".md").read_text()


def smoke_bench(out: Path):
    """The CPU smoke settings, baseline and two exp variants; then, if it succeeded, a split ablation that takes the
    baseline from its result (same settings) and one that may not (another learning rate)."""
    # lr 5e-3 so that four updates move the adapters visibly (compared below through the LoRA B norms).
    # profile=true: the exp rows also say where their profiled steps' time went (by kind of operator on the CPU).
    proc = run_bench(
        out, *SMOKE, "lr=5e-3", "profile=true", "variant=baseline", "variant=exp",
        "variant=exp hardware.loss_impl=chunked",
    )  # fmt: skip
    if proc.returncode != 0:
        return out, proc, None, None
    [first] = out.glob("bench-*.json")
    reused = run_bench(out / "again", *SMOKE, "lr=5e-3", "variant=baseline", f"reference={first}")
    refused = run_bench(out / "again", *SMOKE, f"reference={first}")  # lr 1e-4: not the same settings
    return out, proc, reused, refused


TINY_ALPACA_WORDS = "red green blue fox owl cat dog sun moon star tree leaf".split()
REAL_DATA_SPLIT = "exp hardware.micro_batch_size=2"  # 4 micro-batches of different lengths per step


def real_data_bench(out: Path) -> tuple[Path, subprocess.CompletedProcess, subprocess.CompletedProcess | None]:
    """Real-data mode on a small Alpaca file: baseline, exp, and exp accumulating 4 micro-batches per step; then
    steps 2 and 3 alone (first_step=2), in a directory of their own."""
    words = TINY_ALPACA_WORDS
    rows = [
        {
            "instruction": "Repeat the words.",
            "input": " ".join(words[: 2 + i % 9]),
            "output": " ".join(words[: 2 + i % 9]),
        }
        for i in range(60)
    ]
    data = out / "tiny_alpaca.json"
    data.write_text(json.dumps(rows))
    args = ["model=gemma_tiny", "seq=64", "micro_batch=8", "steps=4", "warmup=1"]
    whole = run_bench(out, *args, f"data={data}", "memory_budget=baseline",
                      "variant=baseline", "variant=exp", f"variant={REAL_DATA_SPLIT}")  # fmt: skip
    if whole.returncode != 0:
        return out, whole, None
    part = run_bench(out / "part", "model=gemma_tiny", "seq=64", "micro_batch=8", "steps=2", "warmup=1",
                     "first_step=2", f"data={data}", "variant=baseline", "variant=exp")  # fmt: skip
    return out, whole, part


def preference_bench(out: Path, objective: str) -> tuple[Path, subprocess.CompletedProcess]:
    """Preference mode on pairs made from a small Alpaca file: the baseline and exp (dpo: and exp's chunked loss)."""
    data = tiny_alpaca(out / "tiny_alpaca.json")
    variants = ["variant=baseline", "variant=exp"]
    if objective == "dpo":
        variants.append("variant=exp hardware.loss_impl=chunked")
    proc = run_bench(out, "model=gemma_tiny", "seq=64", "micro_batch=4", "steps=3", "warmup=1",
                     f"objective={objective}", f"data={data}", *variants)  # fmt: skip
    return out, proc


PREFERENCE_OBJECTIVES = ["dpo", "orpo"]


@pytest.fixture(scope="module")
def benches(request, tmp_path_factory) -> Together:
    """The CPU bench invocations (each a process per variant, mostly imports), side by side."""
    steps = {
        "smoke": partial(smoke_bench, tmp_path_factory.mktemp("smoke")),
        "real-data": partial(real_data_bench, tmp_path_factory.mktemp("real_data")),
        **{o: partial(preference_bench, tmp_path_factory.mktemp(o), o) for o in PREFERENCE_OBJECTIVES},
    }
    uses = {
        "smoke": ["test_bench_runs_both_sides_on_the_same_tokens_with_the_same_losses"],
        "real-data": ["test_bench_real_data_mode_trains_both_sides_on_the_same_examples"],
        **{o: [f"test_bench_preference_mode_trains_both_sides_on_the_same_pairs[{o}]"] for o in PREFERENCE_OBJECTIVES},
    }
    with Together(request, steps, uses) as together:
        yield together


@pytest.mark.slow
def test_bench_runs_both_sides_on_the_same_tokens_with_the_same_losses(benches):
    tmp_path, proc, reused_proc, refused = benches.get("smoke")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report, md = read_report(tmp_path)
    for key in ("command", "date", "device", "versions", "git", "settings", "flops", "rows", "parity_steps"):
        assert key in report, key
    for name in ("torch", "transformers", "peft", "bitsandbytes", "lightning", "cuda"):
        assert name in report["versions"]
    assert report["command"].startswith("python -m exp.bench model=gemma_tiny")
    assert report["flops"]["per_token"] == report["flops"]["linear"] + report["flops"]["attention"]
    rows = {r["variant"]: r for r in report["rows"]}
    assert list(rows) == ["baseline", "exp", "exp hardware.loss_impl=chunked"]
    base = rows["baseline"]
    for r in rows.values():
        assert r["status"] == "ok", r.get("error")
        assert len(r["losses"]) == 5 and all(math.isfinite(v) for v in r["losses"])
        assert len(r["step_s"]) == 5 and r["tokens_per_s"] > 0
        assert r["peak_memory_gib"] is None and r["mfu"] is None  # CUDA-only measures: null on the CPU
        assert r["lora_b_norm"] > 0  # the adapters trained
    assert base["loss_impl"] == "hf" and base["gradient_checkpointing"] is True
    assert rows["exp"]["loss_impl"] == "hf"  # auto on the CPU
    assert rows["exp hardware.loss_impl=chunked"]["loss_impl"] == "chunked"
    for name in ("exp", "exp hardware.loss_impl=chunked"):
        r = rows[name]
        assert r["parity"]["ok"] and r["parity"]["steps"] == 5 and r["parity"]["same_lora_init"]
        assert r["parity"]["max_rel_loss_diff"] <= 0.01
        # Same updates, not only the same first loss: the adapters end where the baseline's do.
        assert r["lora_b_norm"] == pytest.approx(base["lora_b_norm"], rel=1e-3)
        assert r["speedup"] > 0
    # float32 on the CPU: exp's step is the hand-written loop's arithmetic.
    assert rows["exp"]["parity"]["max_rel_loss_diff"] < 1e-5
    assert "| baseline | 2 | hf | full |" in md and "| exp hardware.loss_impl=chunked | 2 | chunked | none |" in md
    # Each worker's output is kept beside the results; exp's says how far its steps got.
    [logs] = tmp_path.glob("bench-*-logs")
    assert sorted(p.name for p in logs.iterdir()) == ["variant-0.log", "variant-1.log", "variant-2.log"]
    exp_log = (logs / "variant-1.log").read_text()
    assert [f"exp.bench: step {i}:" in exp_log for i in range(1, 6)] == [True] * 5
    # The profiled steps (steps 2 and 3, among the timed ones) kept the baseline's arithmetic above.
    assert base.get("profile") is None
    for name in ("exp", "exp hardware.loss_impl=chunked"):
        prof = rows[name]["profile"]
        assert prof["steps"] == 2 and prof["total_ms_per_step"] > 0 and "matmul" in prof["categories"]
        assert sum(c["share"] for c in prof["categories"].values()) == pytest.approx(1, abs=1e-3)
        # The profiled steps' wall-clock, which the device's busy time is compared with.
        assert prof["wall_ms_per_step"] > 0
    assert "Profile of exp (micro-batch 2)" in md and "| matmul |" in md

    # A later invocation (a split ablation) can take the baseline from this result instead of running it again,
    # only when it was measured with the same settings.
    [first] = tmp_path.glob("bench-*.json")
    assert reused_proc.returncode == 0, reused_proc.stderr[-4000:]
    reused, _ = read_report(tmp_path / "again")
    assert [r["variant"] for r in reused["rows"]] == ["baseline"] and reused["rows"][0]["reference_from"] == str(first)
    assert refused.returncode == 2 and "'lr': (0.005, 0.0001)" in refused.stderr


def test_bench_refuses_overrides_that_would_change_one_side_only(tmp_path):
    proc = run_bench(tmp_path, *SMOKE, "lora.r=4")
    assert proc.returncode == 2 and "set by exp.bench for both sides" in proc.stderr
    proc = run_bench(tmp_path, *SMOKE, "variant=baseline fused=true")
    assert proc.returncode == 2 and "ckpt, compile, liger, prepare" in proc.stderr
    proc = run_bench(tmp_path, *SMOKE, "first_step=10")  # random tokens: no order of steps to start in
    assert proc.returncode == 2 and "first_step=10: only real-data mode" in proc.stderr
    assert not list(tmp_path.glob("bench-*"))


def test_lora_variants_are_exp_rows_and_the_shared_lora_settings_stay_the_benchs():
    from exp.bench.variants import Settings, Variant

    for text in ["exp lora=dora", "exp lora.use_rslora=true", "exp lora.plus_lr_ratio=16", "exp lora.init=olora",
                 "exp +lora.rank_pattern.q_proj=32"]:  # fmt: skip
        options = Variant.parse(text).options
        Settings(model="gemma_tiny", device="cpu").exp_config(options)  # composes beside the bench's settings
    cfg = Settings(model="gemma_tiny", device="cpu").exp_config(["lora=dora"])
    assert cfg.lora.use_dora and cfg.lora.r == Settings().lora_r  # the option file's, and the bench's rank
    for text in ["exp lora.r=4", "exp lora.target_modules=[q_proj]", "exp lora.init_seed=3"]:
        with pytest.raises(ValueError, match="set by exp.bench for both sides"):
            Variant.parse(text)


def test_flops_per_token_of_the_gemma_7b_shape():
    from exp.bench.report import model_flops_per_token
    from exp.hardware.memory import config_arch

    arch = config_arch(compose_typed(["model=gemma_7b", "model.random_init=true"]))
    flops = model_flops_per_token(arch, 2048)
    assert flops["n_params"] == 8_537_505_792  # the published 8.54 B, embedding (= head) counted once
    assert flops["per_token"] / 1e9 == pytest.approx(35.56, abs=0.01)  # 4N + causal attention


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_chunked_cross_entropy_matches_torch_in_loss_and_gradients(softcap):
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    t[::3] = IGNORE_INDEX

    def reference(h, w):
        z = h @ w.t()
        z = torch.tanh(z / softcap) * softcap if softcap else z
        return F.cross_entropy(z, t, ignore_index=IGNORE_INDEX)

    expected, grads = reference(h, w), torch.autograd.grad(reference(h, w), (h, w))
    got = chunked_linear_cross_entropy(h, w, t, softcap, chunk_tokens=5)  # 8 chunks, the last one short
    got_grads = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # evaluation: no gradients computed, the same loss
        assert chunked_linear_cross_entropy(h, w, t, softcap, 5).item() == pytest.approx(got.item())
    nothing = torch.full_like(t, IGNORE_INDEX)  # no loss-bearing token: NaN, as torch's mean
    assert chunked_linear_cross_entropy(h, w, nothing, softcap, 5).isnan()


def response_only_batch(cfg, n: int = 4) -> dict[str, torch.Tensor]:
    """Synthetic examples with exp's labels: prompt and padding IGNORE_INDEX, the loss on the responses only."""
    tok = build_tokenizer(cfg.model)
    rows = generate_examples(n, seed=7)
    batch = collate([encode(tok, r)[0] for r in rows], tok.pad_token_id)
    assert (batch["labels"] == IGNORE_INDEX).any() and (batch["attention_mask"] == 0).any()
    return batch


def loss_and_grads(model, batch, impl: LossImpl) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, batch, impl)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_chunked_loss_matches_transformers_loss_on_the_4bit_model(monkeypatch: pytest.MonkeyPatch):
    import exp.model.loss

    cfg = compose_typed(["lora=all_linear", "lora.dropout=0", "logger=none"])
    model = build_model(cfg, "cpu")
    batch = response_only_batch(cfg)
    # 7 tokens per chunk (the tiny vocabulary would otherwise fit one chunk): many chunks, a short last one.
    monkeypatch.setattr(exp.model.loss, "CHUNK_LOGIT_BYTES", 7 * 4 * model.config.vocab_size)
    hf_loss, hf_grads = loss_and_grads(model, batch, LossImpl.hf)
    ch_loss, ch_grads = loss_and_grads(model, batch, LossImpl.chunked)
    assert ch_loss == pytest.approx(hf_loss, rel=1e-6)
    assert hf_grads.keys() == ch_grads.keys() and len(hf_grads) == 2 * 7 * 4  # A and B of 7 projections x 4 layers
    for k, g in hf_grads.items():
        torch.testing.assert_close(ch_grads[k], g, rtol=1e-4, atol=1e-6)


def test_chunked_loss_keeps_gemma2_final_logit_softcap():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, final_logit_softcapping=2.0, attn_implementation="eager",
        initializer_range=0.2,
    )  # fmt: skip
    model = Gemma2ForCausalLM(config).train()  # every weight trained, the tied head too: its gradient is checked
    batch = response_only_batch(compose_typed(["logger=none"]))
    hf_loss, hf_grads = loss_and_grads(model, batch, LossImpl.hf)
    ch_loss, ch_grads = loss_and_grads(model, batch, LossImpl.chunked)
    assert ch_loss == pytest.approx(hf_loss, rel=1e-6)
    for k, g in hf_grads.items():
        torch.testing.assert_close(ch_grads[k], g, rtol=1e-4, atol=1e-6)
    # The softcap matters here: without it the loss would differ.
    model.config.final_logit_softcapping = None
    uncapped, _ = loss_and_grads(model, batch, LossImpl.chunked)
    assert abs(uncapped - hf_loss) > 1e-3


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_chunked_metrics_match_the_full_logits_metrics(softcap):
    torch.manual_seed(0)
    b, t, v = 3, 9, 40
    hidden = torch.randn(b, t, 16, dtype=torch.float64)
    weight = torch.randn(v, 16, dtype=torch.float64)
    labels = torch.randint(0, v, (b, t))
    labels[:, :3] = IGNORE_INDEX  # prompts
    labels[2] = IGNORE_INDEX  # a row without a response: not an example, not an exact match
    logits = hidden @ weight.t()
    logits = torch.tanh(logits / softcap) * softcap if softcap else logits
    # Row 0 answered perfectly (teacher-forced): every next response token is the arg-max.
    labels[0, 3:] = logits[0, 2:-1].argmax(-1)
    rows = torch.arange(b).repeat_interleave(t)
    full = response_metrics(logits, labels, rows)
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    got = chunked_response_metrics(
        hidden.reshape(b * t, -1), weight, targets.reshape(-1), rows, softcap, chunk_tokens=4
    )
    assert got["loss_sum"].item() == pytest.approx(full["loss_sum"].item(), rel=1e-6)  # both in fp32
    assert {k: int(got[k]) for k in ("tokens", "hits", "exact", "examples")} == {
        k: int(full[k]) for k in ("tokens", "hits", "exact", "examples")
    }
    assert int(got["tokens"]) == 2 * 6 and int(got["examples"]) == 2 and int(got["exact"]) >= 1
    # By hand, in float64: position p predicts label p + 1, over the response labels (positions 3 to 8) of rows 0, 1.
    z, t = logits[:2, 2:-1], labels[:2, 3:]
    by_hand = (torch.logsumexp(z, -1) - z.gather(2, t[..., None]).squeeze(2)).sum()
    assert full["loss_sum"].item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_validation_rates_weight_every_token_and_example_of_the_split():
    """Batches of any size, summed with `add_sums`, give the whole split's means (a batch's mean would weight a
    short batch's tokens more): the rates training logs as val/* and exp.evaluate reports."""
    torch.manual_seed(0)
    b, t, v = 5, 7, 11
    logits = torch.randn(b, t, v)
    labels = torch.randint(0, v, (b, t))
    labels[:, :2] = IGNORE_INDEX  # prompts
    labels[1, 4:] = IGNORE_INDEX  # a shorter answer
    labels[0, 2:] = logits[0, 1:-1].argmax(-1)  # row 0 answered exactly (teacher-forced)
    sums: dict[str, torch.Tensor] = {}
    for rows in (slice(0, 1), slice(1, b)):
        n = rows.stop - rows.start
        add_sums(sums, response_metrics(logits[rows], labels[rows], torch.arange(n).repeat_interleave(t)))
    whole = response_metrics(logits, labels, torch.arange(b).repeat_interleave(t))
    tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    rates = validation_rates(sums)
    assert rates == pytest.approx(
        {
            "loss": float(whole["loss_sum"]) / tokens,
            "token_accuracy": int(whole["hits"]) / tokens,
            "exact_match": int(whole["exact"]) / b,
        },
        rel=1e-6,
    )
    assert int(whole["exact"]) >= 1 and all(v.dtype == torch.float64 for v in sums.values())


class _LargestLogits(torch.utils._python_dispatch.TorchDispatchMode):
    """The element count of the largest vocabulary-wide tensor (last dimension `vocab`: logits and what is computed
    from them) any op produces inside the mode, views of the head's own weight left out. The model's other tensors
    are never that wide in the tiny Gemma."""

    def __init__(self, head: torch.Tensor):
        super().__init__()
        self.vocab, self.head, self.largest = head.shape[0], head.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in torch.utils._pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.dim() and x.shape[-1] == self.vocab:
                if x.untyped_storage().data_ptr() != self.head:
                    self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.slow
def test_validation_metrics_follow_the_loss_and_hold_one_chunk_of_logits(monkeypatch: pytest.MonkeyPatch):
    """With the chunked loss, validation's metrics are the full-logits ones without ever holding [tokens, vocab]."""
    import exp.model.metrics

    cfg = compose_typed(["lora.dropout=0", "logger=none"])
    model = build_model(cfg, "cpu").eval()
    batch = response_only_batch(cfg)
    vocab, tokens = model.config.vocab_size, batch["input_ids"].numel()
    head = model.get_output_embeddings().weight
    monkeypatch.setattr(exp.model.metrics, "CHUNK_LOGIT_BYTES", 7 * 4 * vocab)  # 7 tokens per chunk
    with torch.no_grad():
        with _LargestLogits(head) as full_mode:
            full = batch_response_metrics(model, batch, LossImpl.hf)
        with _LargestLogits(head) as chunked_mode:
            chunked = batch_response_metrics(model, batch, LossImpl.chunked)
    assert full_mode.largest >= tokens * vocab  # the check can see a full-logits tensor
    assert 0 < chunked_mode.largest <= 7 * vocab  # one chunk of 7 tokens at a time
    assert chunked["loss_sum"].item() == pytest.approx(full["loss_sum"].item(), rel=1e-5)
    assert all(int(chunked[k]) == int(full[k]) for k in ("tokens", "hits", "exact", "examples"))


def test_loss_impl_is_resolved_per_device_with_fallbacks():
    cfg = compose_typed(["logger=none"])
    model = build_model(cfg, "cpu")
    cpu = torch.device("cpu")
    assert resolve_loss_impl(cfg, model, cpu).impl == LossImpl.hf  # auto on the CPU: the reference numbers
    cfg.hardware.loss_impl = LossImpl.chunked
    assert resolve_loss_impl(cfg, model, cpu).impl == LossImpl.chunked
    cfg.hardware.strategy = Strategy.fsdp
    choice = resolve_loss_impl(cfg, model, cpu)
    assert choice.impl == LossImpl.hf and "FSDP" in choice.reason
    # A trained head (modules_to_save) is more than the head's weight: transformers' loss, saying why.
    cfg = compose_typed(["logger=none", "hardware.loss_impl=chunked", "lora.modules_to_save=[lm_head]"])
    choice = resolve_loss_impl(cfg, build_model(cfg, "cpu"), cpu)
    assert choice.impl == LossImpl.hf and "ModulesToSaveWrapper" in choice.reason
    with pytest.raises(ConfigError, match="loss_impl=liger on the CPU"):
        compose_typed(["hardware.loss_impl=liger"])


def test_fused_adamw_where_torch_has_the_kernel():
    cfg = compose_typed(["logger=none"])
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert build_optimizer(cfg.trainer, params, fused=True).defaults.get("fused")  # torch's fused CPU kernel
    assert not build_optimizer(cfg.trainer, params, fused=False).defaults.get("fused")
    meta = [torch.nn.Parameter(torch.zeros(3, device="meta"))]  # a device type without a fused kernel
    assert not build_optimizer(cfg.trainer, meta, fused=True).defaults.get("fused")


@pytest.mark.gpu
@pytest.mark.slow
def test_bench_on_gpu_uses_the_fast_path(tmp_path):
    proc = run_bench(tmp_path, *SMOKE, "variant=baseline", "variant=exp")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report, _ = read_report(tmp_path)
    rows = {r["variant"]: r for r in report["rows"]}
    exp = rows["exp"]
    assert exp["status"] == "ok" and exp["parity"]["ok"] and exp["parity"]["same_lora_init"]
    assert exp["loss_impl"] in ("liger", "chunked") and exp["fused_adamw"] is True
    assert exp["peak_memory_gib"] > 0 and exp["mfu"] > 0 and rows["baseline"]["peak_memory_gib"] > 0


@pytest.mark.slow
def test_bench_real_data_mode_trains_both_sides_on_the_same_examples(benches):
    """Real-data mode on the CPU (a harness test, not a speed claim): the baseline pads each step's examples, exp
    batches them its own way; both are scored on real tokens and by the validation loss after the same steps."""
    tmp_path, proc, part = benches.get("real-data")
    split = REAL_DATA_SPLIT
    assert proc.returncode == 0, proc.stderr[-4000:]
    report, md = read_report(tmp_path)
    base, exp, accumulated = report["rows"]
    assert (base["variant"], exp["variant"], accumulated["variant"]) == ("baseline", "exp", split)
    # Length grouping within steps: exp's steps hold the baseline's examples, and with the step's loss weighted by
    # its tokens, 4 accumulated micro-batches give the one padded batch's losses (fp32, up to rounding).
    assert accumulated["micro_batch_exp"] == 2 and accumulated["accumulate"] == 4
    for r in (exp, accumulated):
        assert r["real_tokens"] == base["real_tokens"]
        assert r["losses"] == pytest.approx(base["losses"], rel=1e-4)
        # The baseline evaluates with bitsandbytes' CPU inference kernel (bf16 repacking, which exp turns off
        # because it stops gradients): 5e-4 apart on this machine, with the LoRA weights identical.
        assert r["val_loss"] == pytest.approx(base["val_loss"], rel=2e-3)
        assert r["lora_b_norm"] == pytest.approx(base["lora_b_norm"], rel=1e-5)
    for r in (base, exp, accumulated):
        assert r["status"] == "ok", r.get("error")
        assert len(r["real_tokens"]) == 4 and all(n > 0 for n in r["real_tokens"])
        assert math.isfinite(r["val_loss"]) and r["tokens_per_s"] > 0 and r["all_steps_s"] > 0
    # The CPU's exp default (hardware=cpu) takes the step's 8 examples in one micro-batch, as the baseline does.
    assert exp["micro_batch_exp"] * exp["accumulate"] == 8
    assert exp["parity"]["same_lora_init"] and "baseline_val_loss" in exp["parity"]
    assert exp["checkpoint_layers"] == 0 and exp["layers"] == 4
    assert "Real data:" in md and "| variant | all steps s |" in md
    # No GPU here: the baseline has no measured peak, so the exp side ran without a budget.
    assert exp["memory_budget_gib"] is None
    # first_step=2: both sides train steps 2 and 3 of the same order (from fresh adapters): the same examples as the
    # whole run's last two steps, and the same losses on both sides.
    assert part is not None and part.returncode == 0, part.stderr[-4000:] if part else None
    later, _ = read_report(tmp_path / "part")
    assert later["settings"]["first_step"] == 2
    part_base, part_exp = later["rows"]
    assert part_base["real_tokens"] == part_exp["real_tokens"] == base["real_tokens"][2:]
    assert part_exp["losses"] == pytest.approx(part_base["losses"], rel=1e-4)


def tiny_alpaca(path: Path, n: int = 60) -> Path:
    """A small Alpaca file of word-repeating examples (outputs of different lengths)."""
    words = TINY_ALPACA_WORDS
    rows = [{"instruction": "Repeat the words.", "input": " ".join(words[: 2 + i % 9]),
             "output": " ".join(words[i % 5 : 2 + i % 9 + i % 5])} for i in range(n)]  # fmt: skip
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("objective", PREFERENCE_OBJECTIVES)
def test_bench_preference_mode_trains_both_sides_on_the_same_pairs(benches, objective):
    """`objective=dpo|orpo` on the CPU (the code path of the GPU figure, not a speed claim): pairs made from the
    Alpaca file, the hand-written loop (reference: its adapter off) and exp's fit on the same pairs every step, with
    the same losses, the same LoRA init, pairs/s reported; exp's own chunked loss too."""
    from exp.bench.pairs import read_rows

    tmp_path, proc = benches.get(objective)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report, md = read_report(tmp_path)
    assert report["settings"]["objective"] == objective
    pairs = read_rows(Path(report["settings"]["data_path"]))
    assert len(pairs) == 60 and all(p["chosen"] != p["rejected"] for p in pairs)
    base, *exps = report["rows"]
    for r in report["rows"]:
        assert r["status"] == "ok", r.get("error")
        assert r["pairs_per_s"] > 0 and len(r["losses"]) == 3
    if objective == "dpo":  # the adapters start at zero: the policy is the reference, every margin 0
        assert base["losses"][0] == pytest.approx(math.log(2), rel=1e-6)
    for r in exps:
        assert r["real_tokens"] == base["real_tokens"] and r["same_steps"]
        assert r["losses"] == pytest.approx(base["losses"], rel=1e-4)
        assert r["parity"]["ok"] and r["parity"]["same_lora_init"] and r["parity"]["steps"] == 3
        assert r["speedup"] == pytest.approx(r["pairs_per_s"] / base["pairs_per_s"], rel=1e-2)
    assert f"Preference pairs, objective {objective}" in md and "pairs/s (tokens/s)" in md


def test_alpaca_pairs_reject_another_examples_output_deterministically(tmp_path):
    from exp.bench.pairs import alpaca_pairs, preference_file, read_rows

    rows = [{"instruction": f"Say {w}.", "input": "", "output": w} for w in TINY_ALPACA_WORDS]
    rows.append({"instruction": "Say red again.", "input": "twice", "output": "red"})  # a duplicate output
    pairs = alpaca_pairs(rows, seed=0)
    assert pairs == alpaca_pairs(rows, seed=0) != alpaca_pairs(rows, seed=1)
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    # every output is rejected once (a shuffled cycle), except where the pair would be the same text
    assert len(pairs) >= len(rows) - 2
    assert (
        next(p for p in pairs if p["chosen"] == "green")["prompt"] == "### Instruction:\nSay green.\n\n### Response:\n"
    )
    assert "### Input:\ntwice" in next(p["prompt"] for p in pairs if "again" in p["prompt"])
    src = tmp_path / "a.json"
    src.write_text(json.dumps(rows))
    made = preference_file(src, tmp_path / "out", seed=0)
    assert read_rows(made) == pairs and preference_file(made, tmp_path / "other", seed=0) == made


def test_bench_preference_mode_needs_pairs(tmp_path):
    proc = run_bench(tmp_path, "objective=dpo")
    assert proc.returncode == 2 and "add data=" in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"text": "no pairs here"}]))
    proc = run_bench(tmp_path, "objective=orpo", f"data={bad}")
    assert proc.returncode == 2 and "neither preference rows" in proc.stderr


def bench_result(path: Path, side: str, first_step: int, steps: int, *, fingerprint: str = "f0") -> Path:
    """A real-data exp.bench result file as a run writes it (one row: the baseline, or exp padding-free), with
    step times, real tokens and losses that depend on the step only."""
    from dataclasses import asdict

    from exp.bench.report import summarise
    from exp.bench.variants import Settings

    run = Settings(model="gemma_tiny", seq=64, steps=steps, warmup=1, data_path="d.json", first_step=first_step,
                   device="cpu")  # fmt: skip
    settings = {**asdict(run), "micro_batch": [8]}
    span = range(first_step, first_step + steps)
    row = {
        "variant": side, "side": side, "micro_batch": 8, "is_reference": side == "baseline", "status": "ok",
        "step_s": [(2.0 if side == "baseline" else 0.5) + 0.01 * s for s in span],
        "real_tokens": [100 + s for s in span],
        "losses": [10.0 - 0.1 * (s - first_step) + (0.001 if side == "exp" else 0) for s in span],
        "val_loss": 9.0, "lora_fingerprint": fingerprint, "peak_memory_bytes": 2**30 * (1 + first_step),
    }  # fmt: skip
    if side == "exp":
        row["same_steps"] = True
    summarise(row, run, {"per_token": 1.0}, None)
    report = {"command": f"python -m exp.bench first_step={first_step}", "settings": settings, "rows": [row],
              "flops": {"per_token": 1.0}, "peak_tflops": None, "parity_steps": 30, "parity_tol": 0.01,
              "date": "-", "device": "cpu", "versions": {}, "git": {}}  # fmt: skip
    path.write_text(json.dumps(report))
    return path


def test_a_baseline_measured_in_parts_joins_into_the_whole_runs_wall_clock(tmp_path):
    """The loop's 200 steps do not fit one GPU command: exp.bench takes them in parts (first_step), and the parts
    join into one baseline row beside exp's whole run: the steps' times and real tokens end to end, the per-step
    losses of the first part only (the later ones started from fresh adapters), no validation loss."""
    exp_run = bench_result(tmp_path / "exp.json", "exp", 0, 4)
    parts = [bench_result(tmp_path / "b2.json", "baseline", 2, 2), bench_result(tmp_path / "b0.json", "baseline", 0, 2)]
    join = [sys.executable, str(ROOT / "benchmarks" / "join_bench.py")]
    proc = subprocess.run([*join, str(exp_run), *map(str, parts)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    joined = json.loads((tmp_path / "exp-joined.json").read_text())
    base, exp = joined["rows"]
    assert base["parts"] == 2 and base["real_tokens"] == exp["real_tokens"] == [100, 101, 102, 103]
    assert base["step_s"] == pytest.approx([2.0, 2.01, 2.02, 2.03])  # in step order, whatever order they came in
    assert base["all_steps_s"] == pytest.approx(8.06) and base["val_loss"] is None
    assert base["losses"] == pytest.approx([10.0, 9.9]) and base["peak_memory_gib"] == 3.0
    assert exp["all_steps_speedup"] == pytest.approx(round(8.06 / 2.06, 3))
    assert exp["parity"]["steps"] == 2 and exp["parity"]["ok"] and exp["parity"]["same_lora_init"]
    md = (tmp_path / "exp-joined.md").read_text()
    assert "| exp | 2.06 | 3.91x | 406 |" in md and "2 parts of one run joined end to end" in md

    # Parts that leave a gap, cover other steps, or started from other adapters are refused with what is wrong.
    gap = bench_result(tmp_path / "b3.json", "baseline", 3, 1)
    proc = subprocess.run([*join, str(exp_run), str(parts[1]), str(gap)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "starts at step 3, where the parts before it end at step 2" in proc.stderr
    proc = subprocess.run([*join, str(exp_run), str(parts[1])], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "steps': (2, 4)" in proc.stderr  # one file: the same settings, steps included
    other = bench_result(tmp_path / "b2x.json", "baseline", 2, 2, fingerprint="f1")
    proc = subprocess.run([*join, str(exp_run), str(parts[1]), str(other)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "LoRA inits differ" in proc.stderr


def test_an_earlier_baseline_row_is_reused_only_from_the_same_card_and_data(tmp_path):
    """`reference=`: the bench's pairs live in each run's own out_dir, so the data is matched by file name; a row
    measured on another card is refused (its speed-up would compare cards), naming both."""
    from dataclasses import asdict

    from exp.bench.report import reference_rows
    from exp.bench.variants import Settings

    def settings(out_dir: str) -> Settings:
        return Settings(steps=2, warmup=0, data_path=f"{out_dir}/pairs-alpaca_en_demo-seed0.jsonl", objective="dpo")

    row = {"variant": "baseline", "is_reference": True, "micro_batch": 8, "status": "ok", "step_s": [1.0, 1.0]}
    path = tmp_path / "bench-earlier.json"
    earlier = {"settings": asdict(settings("/tmp/a")), "device": "NVIDIA H100 80GB HBM3", "rows": [row]}
    path.write_text(json.dumps(earlier))
    here = settings("/tmp/b")
    [reused] = reference_rows([path], here, [8], {}, None, "NVIDIA H100 80GB HBM3")
    assert reused["reference_from"] == str(path) and reused["step_s"] == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"measured on NVIDIA H100 80GB HBM3, this run is on NVIDIA H200"):
        reference_rows([path], here, [8], {}, None, "NVIDIA H200")
    other = Settings(**{**asdict(here), "data_path": "/tmp/b/pairs-alpaca_zh_demo-seed0.jsonl"})
    with pytest.raises(ValueError, match=r"measured with other settings.*data_path"):
        reference_rows([path], other, [8], {}, None, "NVIDIA H100 80GB HBM3")
