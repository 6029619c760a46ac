"""Per-format rendering: one data row -> text segments, each marked as prompt (no loss) or response (loss).

Every format reduces to the same shape, so masking, `<bos>` / `<eos>` handling and truncation (`exp.data.encoding`)
and packing (`exp.data.packing`) are written once. A row that lacks a required field, or holds a non-string where
text is expected, raises `BadRow` with a reason; the caller collects those per row (skip or fail,
`data.on_bad_rows`).

| format            | required fields (config key)                        | rendering                                   |
|-------------------|-----------------------------------------------------|---------------------------------------------|
| synthetic, alpaca | instruction (+ optional input), output              | the Alpaca template, then the output        |
| prompt_completion | prompt, completion                                  | prompt verbatim, completion verbatim        |
| chat              | messages: [{role, content}] (+ optional tools,      | the tokenizer's chat template               |
|                   | assistant tool_calls, tool results)                 |                                             |
| sharegpt          | conversations: [{from, value}]                      | mapped to roles, then the chat template     |
| text              | text                                                | all of it carries loss (continued pretraining) |
| guanaco           | text: "### Human: ... ### Assistant: ..."           | the text verbatim; the assistant parts carry loss |
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from exp.core.config import ConfigError, DataConfig, DataFormat


class BadRow(ValueError):
    """A row that cannot be rendered: missing field, wrong type, no response. The message is the reason."""


@dataclass
class Rendered:
    """Text pieces in order; `response[i]` says whether piece i carries the loss."""

    texts: list[str]
    response: list[bool]
    # Plain formats end the response with <eos> so the model learns to stop; chat formats end each assistant turn
    # with the template's end-of-turn marker (Gemma: <end_of_turn>), which is the stop token there.
    add_eos: bool = True


def format_prompt(instruction: str, input_text: str) -> str:
    """The Alpaca prompt; the response follows it directly."""
    if input_text:
        return f"### Instruction:\n{instruction}\n\n### Input:\n{input_text}\n\n### Response:\n"
    return f"### Instruction:\n{instruction}\n\n### Response:\n"


# ShareGPT speakers -> chat roles. Anything else is a bad row (named in the report).
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}
CHAT_ROLES = ("system", "user", "assistant")
TOOL_ROLE = "tool"  # format=chat only: a tool's result (OpenAI's convention), rendered as prompt
GUANACO_TURN = re.compile(r"(### Human:|### Assistant:)")


def required_columns(cfg: DataConfig) -> list[str]:
    """The columns a file must have for `cfg.format`, as mapped by the config (checked before any row is read)."""
    return {
        DataFormat.synthetic: [cfg.instruction_field, cfg.output_field],
        DataFormat.alpaca: [cfg.instruction_field, cfg.output_field],
        DataFormat.prompt_completion: [cfg.prompt_field, cfg.completion_field],
        DataFormat.chat: [cfg.messages_field],
        DataFormat.sharegpt: [cfg.messages_field],
        DataFormat.text: [cfg.text_field],
        DataFormat.guanaco: [cfg.text_field],
        DataFormat.preference: [cfg.chosen_field, cfg.rejected_field],
        DataFormat.kto: [cfg.prompt_field, cfg.completion_field, cfg.label_field],
    }[cfg.format]


def field_key(cfg: DataConfig, column: str) -> str:
    """The config key that names `column` (for error messages that say how to remap it)."""
    for key in (
        "instruction",
        "input",
        "output",
        "prompt",
        "completion",
        "messages",
        "tools",
        "text",
        "chosen",
        "rejected",
        "label",
    ):
        if getattr(cfg, f"{key}_field") == column:
            return f"data.{key}_field"
    return "data.<format>_field"


def _text(row: dict[str, Any], column: str, optional: bool = False) -> str:
    value = row.get(column)
    if value is None:
        if optional:
            return ""
        raise BadRow(f"missing '{column}'")
    if not isinstance(value, str):
        raise BadRow(f"'{column}' is {type(value).__name__}, not a string")
    return value


def render_row(cfg: DataConfig, row: dict[str, Any], tokenizer: Any) -> Rendered:
    """Render one row of `cfg.format` into prompt / response pieces. Raises `BadRow` for unusable rows."""
    f = cfg.format
    if f in (DataFormat.synthetic, DataFormat.alpaca):
        instruction, output = _text(row, cfg.instruction_field), _text(row, cfg.output_field)
        input_text = _text(row, cfg.input_field, optional=True)
        _non_empty(output, cfg.output_field)
        return Rendered([format_prompt(instruction, input_text), output], [False, True])
    if f == DataFormat.prompt_completion:
        prompt, completion = _text(row, cfg.prompt_field), _text(row, cfg.completion_field)
        _non_empty(completion, cfg.completion_field)
        return Rendered([prompt, completion], [False, True])
    if f == DataFormat.text:
        text = _text(row, cfg.text_field)
        _non_empty(text, cfg.text_field)
        return Rendered([text], [True])
    if f == DataFormat.guanaco:
        return render_guanaco(_text(row, cfg.text_field))
    messages = _messages(row, cfg)
    return render_chat(messages, tokenizer, _tools(row, cfg), cfg.tools_field)


def _non_empty(text: str, column: str) -> None:
    if not text.strip():
        raise BadRow(f"'{column}' is empty: nothing to learn")


def render_guanaco(text: str) -> Rendered:
    """oasst1 / Guanaco text: the `### Human:` parts and the markers are prompt, the `### Assistant:` parts respond."""
    parts = GUANACO_TURN.split(text)
    texts, response = [parts[0]], [False]
    speaker = None
    for piece in parts[1:]:
        if piece in ("### Human:", "### Assistant:"):
            speaker = piece
            texts.append(piece)
            response.append(False)
        elif speaker == "### Assistant:":
            # The separating space stays with the marker; the answer is what follows it.
            lead = piece[: len(piece) - len(piece.lstrip())]
            body = piece[len(lead) :]
            # A trailing newline before the next "### Human:" belongs to the prompt side.
            tail = body[len(body.rstrip()) :]
            texts += [lead, body[: len(body) - len(tail)], tail]
            response += [False, True, False]
        else:
            texts.append(piece)
            response.append(False)
    if not any(r and t.strip() for t, r in zip(texts, response, strict=True)):
        raise BadRow("no '### Assistant:' answer in 'text'")
    # Stop after the last answer: anything after it (a dangling question) would only be prompt.
    last = max(i for i, r in enumerate(response) if r)
    return Rendered(texts[: last + 1], response[: last + 1])


def _messages(row: dict[str, Any], cfg: DataConfig) -> list[dict[str, Any]]:
    raw = row.get(cfg.messages_field)
    if raw is None:
        raise BadRow(f"missing '{cfg.messages_field}'")
    if not isinstance(raw, list) or not raw:
        raise BadRow(f"'{cfg.messages_field}' is not a non-empty list of messages")
    sharegpt = cfg.format == DataFormat.sharegpt
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    messages = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict) or role_key not in m or content_key not in m:
            raise BadRow(f"message {j} lacks '{role_key}' / '{content_key}'")
        role, content = m[role_key], m[content_key]
        calls = None if sharegpt else m.get("tool_calls")
        if content is None and calls:  # an assistant turn that only calls tools has no text
            content = ""
        if not isinstance(content, str) or not isinstance(role, str):
            raise BadRow(f"message {j}: '{content_key}' and '{role_key}' must be strings")
        role = SHAREGPT_ROLES.get(role.lower(), role) if sharegpt else role
        roles = CHAT_ROLES if sharegpt else (*CHAT_ROLES, TOOL_ROLE)
        if role not in roles:
            raise BadRow(f"message {j} has role '{m[role_key]}' (expected one of {', '.join(roles)})")
        message: dict[str, Any] = {"role": role, "content": content}
        if calls:
            if role != "assistant":
                raise BadRow(f"message {j}: only assistant messages make tool_calls (this one is '{role}')")
            message["tool_calls"] = [_tool_call(c, j) for c in calls]
        if role == TOOL_ROLE:  # templates that name the answering function read these
            message.update({k: m[k] for k in ("name", "tool_call_id") if m.get(k) is not None})
        messages.append(message)
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
        raise BadRow("no assistant message: nothing to learn")
    return messages


def _tool_call(call: Any, j: int) -> dict[str, Any]:
    """One OpenAI-style call ({"type": "function", "function": {"name", "arguments"}}) with its arguments as an
    object: OpenAI writes them as a JSON string, chat templates (transformers' convention) read a mapping."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRow(f"message {j}: a tool call lacks 'function': {{'name', 'arguments'}}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise BadRow(f"message {j}: the arguments of call '{function['name']}' are not JSON ({e})") from e
    return {"type": "function", "function": {"name": function["name"], "arguments": _without_nulls(arguments or {})}}


def _without_nulls(value: Any) -> Any:
    """Drop null members: `datasets` reads JSON objects of one column as one struct type, so a key present in some
    rows' tools or arguments appears as null in all the others, which no row wrote."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _tools(row: dict[str, Any], cfg: DataConfig) -> list[dict[str, Any]] | None:
    tools = row.get(cfg.tools_field) if cfg.format == DataFormat.chat else None
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRow(f"'{cfg.tools_field}' is not a list of function declarations")
    return _without_nulls(tools) or None


def render_chat(
    messages: list[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None = None, tools_key: str = "tools"
) -> Rendered:
    """Render with the tokenizer's chat template, marking every assistant turn (its text and its tool calls) as
    response; tool results, like user and system turns, are prompt.

    The template is applied to growing prefixes of the conversation; the text each assistant message adds after
    the generation prompt is its response (for Gemma: the content and `<end_of_turn>`). This works for any
    template that renders a conversation's prefix as a prefix of its text, which chat templates do by design;
    one that does not raises `BadRow` rather than guessing a mask.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise BadRow("the tokenizer has no chat template (use format=alpaca or prompt_completion)")
    if tools or any(m["role"] == TOOL_ROLE or m.get("tool_calls") for m in messages):
        if problem := tool_template_problem(tokenizer.chat_template, tokenizer):
            raise ConfigError(
                f"the data has tool calls ('{tools_key}', assistant 'tool_calls' or 'tool' messages) but {problem}. "
                "Train with a tokenizer whose chat template renders tools (declarations, calls and results; the "
                "built-in tiny model's does), or leave those rows out of data.path"
            )
    # Gemma's template rejects the system role; fold it into the first user message, as Google's docs advise.
    if messages[0]["role"] == "system" and len(messages) > 1 and messages[1]["role"] == "user":
        try:
            _apply(tokenizer, messages[:2], False, tools)
        except BadRow:
            merged = {"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}
            messages = [merged] + messages[2:]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    messages = messages[: last + 1]  # a trailing user turn has no answer to learn
    texts, response, done = [], [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _apply(tokenizer, messages[:i], True, tools)
        full = _apply(tokenizer, messages[: i + 1], False, tools)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise BadRow("the chat template does not render a conversation prefix as a text prefix; cannot mask it")
        answer = full[len(prompt) :]
        tail = answer[len(answer.rstrip()) :]  # the newline after the end-of-turn marker is layout, not answer
        texts += [prompt[len(done) :], answer[: len(answer) - len(tail)]]
        response += [False, True]
        done = full[: len(full) - len(tail)]
    return Rendered(texts, response, add_eos=False)


# A conversation that uses every part of tool calling, with names no template writes by itself: a template that
# renders tools writes each of them; one that drops any (Gemma's own templates have no tools, no tool_calls and no
# tool role) would leave calls unlearnt or results unseen without a word.
PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_declared_fn", "parameters": {"type": "object"}}}]
PROBE_CALL = {"type": "function", "function": {"name": "probe_called_fn", "arguments": {"x": 1}}}
PROBE = [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]},
    {"role": "tool", "content": "probe_result_text"},
    {"role": "assistant", "content": "a"},
]


@functools.lru_cache(maxsize=8)
def tool_template_problem(template: str, tokenizer: Any) -> str | None:
    """What the chat template fails to render of a tool conversation (None: it renders declarations, calls and
    results). Cached per template: every row of a source asks."""
    try:
        text = tokenizer.apply_chat_template(PROBE, tools=PROBE_TOOLS, tokenize=False)
    except Exception as e:  # jinja raises its own types for unsupported roles
        return f"the tokenizer's chat template rejects them ({type(e).__name__}: {e})"
    parts = {
        "the declarations": "probe_declared_fn",
        "the calls": "probe_called_fn",
        "the results": "probe_result_text",
    }
    dropped = [what for what, marker in parts.items() if marker not in text]
    return f"the tokenizer's chat template drops {', '.join(dropped)}" if dropped else None


def _apply(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list | None = None
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja raises TemplateError / its own exceptions for unsupported conversations
        raise BadRow(f"the chat template rejected the conversation ({type(e).__name__}: {e})") from e
