"""Every data format: rendering, the loss mask token for token, <bos> exactly once, and a short real training run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHORT, compose_typed

from exp.core.constants import IGNORE_INDEX
from exp.data.encoding import encode_rendered
from exp.data.formats import BadRow, render_row
from exp.model.build import build_tokenizer

# One row per format, and the exact text the loss must cover (response) and must not (prompt).
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "See you"},
]
CASES = {
    "alpaca": (
        {"instruction": "Repeat", "input": "red fox", "output": "red fox"},
        "<bos>### Instruction:\nRepeat\n\n### Input:\nred fox\n\n### Response:\n",
        "red fox<eos>",
    ),
    "prompt_completion": ({"prompt": "Q: two?\nA:", "completion": " 2"}, "<bos>Q: two?\nA:", " 2<eos>"),
    "chat": (
        {"messages": CHAT},
        # Gemma's template (here one that accepts a system turn); every model turn carries loss.
        "<bos><start_of_turn>system\nBe brief.<end_of_turn>\n<start_of_turn>user\nHi<end_of_turn>\n"
        "<start_of_turn>model\n"
        "\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n",
        "Hello there<end_of_turn>See you<end_of_turn>",
    ),
    "sharegpt": (
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "Hello<end_of_turn>",
    ),
    "text": ({"text": "Once upon a time."}, "<bos>", "Once upon a time.<eos>"),
    "guanaco": (
        {"text": "### Human: Hi ### Assistant: Hello\n### Human: Bye ### Assistant: See you"},
        "<bos>### Human: Hi ### Assistant: \n### Human: Bye ### Assistant: ",
        "HelloSee you<eos>",
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(compose_typed([]).model)


def data_cfg(fmt: str, *extra: str):
    return compose_typed([f"data={fmt}", "data.path=placeholder.jsonl", *extra]).data


def split_by_label(tokenizer, enc) -> tuple[str, str]:
    """Decode the loss-bearing tokens and the loss-free ones separately (token 0 is never predicted: no loss)."""
    loss = [
        t for k, (t, lab) in enumerate(zip(enc.input_ids, enc.labels, strict=True)) if k > 0 and lab != IGNORE_INDEX
    ]
    free = [
        t for k, (t, lab) in enumerate(zip(enc.input_ids, enc.labels, strict=True)) if k == 0 or lab == IGNORE_INDEX
    ]
    return tokenizer.decode(loss), tokenizer.decode(free)


@pytest.mark.parametrize("fmt", list(CASES))
def test_mask_is_right_token_for_token_and_bos_once(fmt, tokenizer):
    row, prompt_text, response_text = CASES[fmt]
    cfg = data_cfg(fmt)
    enc, truncated = encode_rendered(tokenizer, render_row(cfg, row, tokenizer), 512, train_on_prompt=False)
    assert not truncated
    # A single prompt token with loss (or response token without) changes one of these two strings.
    loss_text, free_text = split_by_label(tokenizer, enc)
    assert loss_text == response_text
    assert free_text == prompt_text
    assert enc.input_ids[0] == tokenizer.bos_token_id and enc.input_ids.count(tokenizer.bos_token_id) == 1
    # Labels are the ids themselves where they carry loss (no shifting, no substitution).
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(enc.input_ids, enc.labels, strict=True))
    full, _ = encode_rendered(tokenizer, render_row(cfg, row, tokenizer), 512, train_on_prompt=True)
    assert full.labels == full.input_ids


def test_bos_once_with_a_template_that_adds_none(tokenizer):
    """A chat template without {{ bos_token }} gets <bos> prepended; one that has it gets no second."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tokenizer.chat_template.replace("{{ bos_token }}", "")
    cfg = data_cfg("chat")
    for t in (tok, tokenizer):
        enc, _ = encode_rendered(t, render_row(cfg, CASES["chat"][0], t), 512, False)
        assert enc.input_ids.count(tokenizer.bos_token_id) == 1 and enc.input_ids[0] == tokenizer.bos_token_id


def test_system_turn_is_folded_into_the_first_user_turn_when_the_template_rejects_it(tokenizer):
    """Google's Gemma template raises on a system turn; the system text then prefixes the first user message."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + tokenizer.chat_template
    )
    enc, _ = encode_rendered(tok, render_row(data_cfg("chat"), CASES["chat"][0], tok), 512, False)
    loss_text, free_text = split_by_label(tok, enc)
    assert free_text.startswith("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>")
    assert loss_text == "Hello there<end_of_turn>See you<end_of_turn>"


def test_column_mapping_for_every_field(tokenizer):
    cfg = data_cfg("prompt_completion", "data.prompt_field=q", "data.completion_field=a")
    enc, _ = encode_rendered(tokenizer, render_row(cfg, {"q": "x", "a": "y"}, tokenizer), 64, False)
    assert split_by_label(tokenizer, enc)[0] == "y<eos>"
    cfg = data_cfg("chat", "data.messages_field=dialog")
    assert render_row(cfg, {"dialog": CHAT}, tokenizer).response.count(True) == 2


@pytest.mark.parametrize(
    "fmt,row,reason",
    [
        ("alpaca", {"instruction": "x"}, "missing 'output'"),
        ("alpaca", {"instruction": "x", "output": 3}, "'output' is int, not a string"),
        ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
        ("sharegpt", {"conversations": [{"from": "human"}]}, "lacks 'from' / 'value'"),
        ("guanaco", {"text": "### Human: only a question"}, "no '### Assistant:' answer"),
        ("text", {"text": "   "}, "is empty"),
    ],
)
def test_bad_rows_are_named(fmt, row, reason, tokenizer):
    with pytest.raises(BadRow, match=reason):
        render_row(data_cfg(fmt), row, tokenizer)


def test_truncation_cuts_the_response_and_drops_when_nothing_is_left(tokenizer):
    cfg = data_cfg("chat")
    rendered = render_row(cfg, CASES["chat"][0], tokenizer)
    full, _ = encode_rendered(tokenizer, rendered, 512, False)
    cut, truncated = encode_rendered(tokenizer, rendered, len(full.input_ids) - 2, False)
    assert truncated and cut.input_ids == full.input_ids[:-2] and cut.labels == full.labels[:-2]
    first_answer = next(k for k, lab in enumerate(full.labels) if lab != IGNORE_INDEX)
    gone, truncated = encode_rendered(tokenizer, rendered, first_answer, False)
    assert gone is None and truncated


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def rows_for(fmt: str, n: int = 24) -> list[dict]:
    words = ["red", "fox", "owl", "bee", "leaf", "blue"]
    out = []
    for i in range(n):
        a, b = words[i % 6], words[(i * 5 + 1) % 6]
        out.append(
            {
                "alpaca": {"instruction": "Repeat", "input": f"{a} {b}", "output": f"{a} {b}"},
                "prompt_completion": {"prompt": f"Repeat: {a} {b}\n", "completion": f"{a} {b}"},
                "chat": {"messages": [{"role": "user", "content": f"{a} {b}"}, {"role": "assistant", "content": a}]},
                "sharegpt": {"conversations": [{"from": "human", "value": f"{a} {b}"}, {"from": "gpt", "value": b}]},
                "text": {"text": f"The {a} met the {b}. " * (1 + i % 3)},
                "guanaco": {"text": f"### Human: {a} {b} ### Assistant: {b} {a}"},
            }[fmt]
        )
    return out


@pytest.mark.parametrize("fmt", list(CASES))
@pytest.mark.slow
def test_each_format_trains_end_to_end_on_the_tiny_4bit_model(fmt, tmp_path):
    from exp.train import run

    path = write_rows(tmp_path / f"{fmt}.jsonl", rows_for(fmt))
    result = run(
        SHORT
        + [
            f"data={fmt}",
            f"data.path={path}",
            "data.max_seq_len=64",
            "data.val_size=8",
            "trainer.max_steps=4",
            "trainer.val_every_n_steps=4",
            "data.packing=false",  # packed training is covered in test_packing.py
        ],
        output_dir=tmp_path / "run",
    )
    summary = json.loads((result.output_dir / "summary.json").read_text())
    assert summary["data"]["train"]["kept"] == 16 and summary["data"]["val"]["kept"] == 8
    assert summary["data"]["train"]["loss_tokens"] > 0
    assert result.final_val["val/loss"] < result.initial_val["val/loss"]


TOOL_ROWS = [
    json.loads(line) for line in (Path(__file__).parent / "data" / "tool_calls.jsonl").read_text().splitlines()
]


def test_tool_calls_carry_loss_and_tool_results_do_not(tokenizer):
    """OpenAI-style tools / tool_calls / tool messages: the declarations open the first turn, the assistant's calls
    and answers carry the loss token for token, the tool's result is prompt; string arguments are parsed."""
    enc, _ = encode_rendered(tokenizer, render_row(data_cfg("chat"), TOOL_ROWS[1], tokenizer), 512, False)
    loss_text, free_text = split_by_label(tokenizer, enc)
    assert loss_text == (
        'Let me add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><end_of_turn>'
        "2 + 3 = 5.<end_of_turn>"
    )
    assert free_text == (
        "<bos><start_of_turn>user\nYou can call these functions:\n<tools>\n"
        '{"name": "add", "description": "Add two integers", "parameters": {"type": "object", "properties": '
        '{"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}\n</tools>\n\n'
        "What is 2 + 3?<end_of_turn>\n<start_of_turn>model\n\n"
        "<start_of_turn>user\n<tool_response>\n5\n</tool_response><end_of_turn>\n<start_of_turn>model\n"
    )
    # A call without text (content null) is a response of its own.
    enc, _ = encode_rendered(tokenizer, render_row(data_cfg("chat"), TOOL_ROWS[0], tokenizer), 512, False)
    assert split_by_label(tokenizer, enc)[0].startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city"')


def test_nulls_that_datasets_adds_to_tools_and_calls_are_dropped(tokenizer):
    """`datasets` reads the objects of a column as one struct type: a key that only some rows' tools or calls have
    comes back as null in the others, which no row wrote; the rendering drops nulls."""
    row = json.loads(json.dumps(TOOL_ROWS[1]))
    row["tools"][0]["function"]["strict"] = None
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"a": 2, "b": 3, "c": None}
    rendered = "".join(render_row(data_cfg("chat"), row, tokenizer).texts)
    assert "null" not in rendered and '"arguments": {"a": 2, "b": 3}' in rendered


def test_a_template_without_tools_is_refused_naming_the_fields(tokenizer):
    """Gemma's own template has no tool role and ignores tool_calls: training would silently learn empty turns."""
    import copy

    from exp.core.config import ConfigError

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\\n' + "
        "(message['content'] or '') + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(
        ConfigError, match="'tools', assistant 'tool_calls' or 'tool' messages.*drops the declarations, the calls"
    ):
        render_row(data_cfg("chat"), TOOL_ROWS[1], tok)
    render_row(data_cfg("chat"), TOOL_ROWS[2], tok)  # a row without tools still renders
