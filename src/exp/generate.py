"""`python -m exp.generate run=<run dir> prompt="..."`: answers from a trained adapter, streamed to the terminal.

Two prompt formats:
- `template=alpaca` (default): the prompt format the run trained with (`exp.data.formats.format_prompt`: `### Instruction:`
  ... `### Response:`), with `<bos>` once, exactly as training tokenised it; `input="..."` fills its Input field.
- `template=chat`: the model family's chat template saved with the tokenizer (Gemma's `<start_of_turn>user` ...),
  for adapters trained on chat-formatted data or to talk to an instruction-tuned base.

Greedy by default; `do_sample=true` samples with `temperature`, `top_p` and `seed` (same seed, same text).
`interactive=true` reads one prompt per line from stdin until an empty line or end of input (with `prompt=` also
given, each line is the Input of that instruction).

    python -m exp.generate run=<run> prompt="Repeat the words exactly." input="red fox owl"
    python -m exp.generate run=<run> prompt="Name a colour." template=chat do_sample=true temperature=0.7 seed=1
    python -m exp.generate run=<run> interactive=true
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exp.core.cli import Key, Tool
from exp.core.config import ConfigError
from exp.data.formats import format_prompt
from exp.run.inference import (
    MODEL_PATH_HELP,
    RUN_KEYS,
    VERBOSE_KEY,
    LoadedRun,
    load_run,
    parse_args,
    passes_model_path,
    resolve_run_dir,
    run_cli,
)

TEMPLATES = ("alpaca", "chat")
TOOL = Tool(
    "exp.generate",
    __doc__,
    (
        *RUN_KEYS,
        Key("prompt", None, "the instruction (template=alpaca) or the user message (template=chat)"),
        Key("input", "", "the Alpaca template's Input field"),
        Key("template", "alpaca", "the prompt format", choices=TEMPLATES),
        Key("interactive", False, "read one prompt per line from stdin, until an empty line"),
        Key("max_new_tokens", 64, "the longest answer, in tokens", at_least=1),
        Key("do_sample", False, "sample instead of greedy decoding"),
        Key("temperature", 1.0, "sampling temperature", above=0),
        Key("top_p", 1.0, "nucleus sampling's probability mass", above=0, at_most=1),
        Key("seed", 0, "the sampling seed (same seed, same text)", at_least=0),
        VERBOSE_KEY,
    ),
    passes=passes_model_path,
    passes_help=MODEL_PATH_HELP,
)


@dataclass
class GenerationOptions:
    """Decoding settings; names as in transformers' `generate`."""

    template: str = "alpaca"
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise ConfigError(f"template={self.template}: allowed values are {', '.join(TEMPLATES)}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: must be >= 1, e.g. max_new_tokens=64")
        if self.do_sample and (self.temperature <= 0 or not 0 < self.top_p <= 1):
            raise ConfigError(
                f"temperature={self.temperature}, top_p={self.top_p}: sampling needs temperature > 0 and "
                "0 < top_p <= 1 (for greedy decoding use do_sample=false)"
            )


def prompt_ids(tokenizer: Any, prompt: str, input_text: str, template: str) -> list[int]:
    """Token ids of the prompt, ending where the model's answer begins."""
    if template == "alpaca":
        # As training encodes an Alpaca row (exp.data.encoding.encode_rendered): the text without special
        # tokens, `<bos>` added once.
        text = format_prompt(prompt, input_text)
        return [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
    if not tokenizer.chat_template:
        raise ConfigError("template=chat: this tokenizer has no chat template; use template=alpaca")
    content = f"{prompt}\n\n{input_text}" if input_text else prompt
    # The template writes `<bos>` itself; tokenising its text must not add a second one.
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_ids(tokenizer: Any) -> list[int]:
    """`<eos>` ends an Alpaca answer; Gemma's chat turns end with `<end_of_turn>`."""
    ids = [tokenizer.eos_token_id]
    turn_end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if isinstance(turn_end, int) and turn_end != tokenizer.unk_token_id:
        ids.append(turn_end)
    return ids


@torch.no_grad()
def generate_ids(
    loaded: LoadedRun, prompt: str, input_text: str = "", opts: GenerationOptions | None = None, streamer=None
) -> list[int]:
    """The answer's token ids (the stop token excluded)."""
    opts = opts or GenerationOptions()
    ids = torch.tensor([prompt_ids(loaded.tokenizer, prompt, input_text, opts.template)], device=loaded.device)
    sampling = {"do_sample": False}
    if opts.do_sample:
        torch.manual_seed(opts.seed)
        sampling = {"do_sample": True, "temperature": opts.temperature, "top_p": opts.top_p, "top_k": 0}
    stops = stop_ids(loaded.tokenizer)
    out = loaded.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=opts.max_new_tokens,
        eos_token_id=stops,
        pad_token_id=loaded.tokenizer.pad_token_id,
        use_cache=True,  # training switches the model config's cache off; decoding wants it
        streamer=streamer,
        **sampling,
    )[0, ids.shape[1] :].tolist()
    return out[:-1] if out and out[-1] in stops else out


def generate_text(loaded: LoadedRun, prompt: str, input_text: str = "", opts: GenerationOptions | None = None) -> str:
    return loaded.tokenizer.decode(generate_ids(loaded, prompt, input_text, opts), skip_special_tokens=True)


def answer(loaded: LoadedRun, prompt: str, input_text: str, opts: GenerationOptions) -> None:
    """Stream one answer to stdout as it is decoded."""
    from transformers import TextStreamer

    streamer = TextStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
    generate_ids(loaded, prompt, input_text, opts, streamer=streamer)
    sys.stdout.flush()


def generate(argv: list[str]) -> None:
    args = parse_args(argv, TOOL)
    opts = GenerationOptions(**{k: args[k] for k in GenerationOptions.__dataclass_fields__})
    if not args["interactive"] and not args["prompt"]:
        raise ConfigError(
            'exp.generate: give prompt="..." (and input="..." for the Alpaca Input field), or interactive=true'
        )
    run_dir = resolve_run_dir(args["run"], args["ckpt"], "exp.generate")
    loaded = load_run(run_dir, ckpt=Path(args["ckpt"]).expanduser() if args["ckpt"] else None, overrides=args)
    if not args["interactive"]:
        answer(loaded, args["prompt"], args["input"], opts)
        return
    tty = sys.stdin.isatty()
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline().strip()
        if not line:  # end of input, or an empty line
            return
        # With prompt= fixed (an instruction), each line is its Input; otherwise each line is the instruction.
        if args["prompt"]:
            answer(loaded, args["prompt"], line, opts)
        else:
            answer(loaded, line, args["input"], opts)


def main(argv: list[str] | None = None) -> None:
    run_cli(TOOL, generate, argv)


if __name__ == "__main__":
    main()
