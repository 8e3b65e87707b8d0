"""Train the fixture model: a small Llama that plays the built-in scenarios, hijackable by the page.

    .venv/bin/python -m agent.models.train_fixture --out agent/models/fixture --seconds 150

No pretrained weights can be downloaded here, so the tests and the demo use a model made by this
script: a byte-level BPE tokenizer trained with `tokenizers` on the conversations, a ChatML chat
template with tools in the Qwen2.5 layout (tool calls as Hermes `<tool_call>` JSON), and a 2-layer,
128-wide Llama trained on about 2,000 conversations of `fixture_data` (loss on the model's turns
only). The conversations are rendered through `agent.chat.ChatRenderer`, the runtime's own
renderer, so the model is trained on exactly the token layout it will see. The output is a standard
Hugging Face model directory, loaded with `from_pretrained` like any user's model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from agent.models.fixture_data import conversation, tool_manifests

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Added (not special) tokens, as in Qwen2.5: they survive `skip_special_tokens`, so a server that strips
#: special tokens from its text still returns the tool-call markers.
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

#: ChatML with tools in the Qwen2.5 layout; every tool result is a turn of its own (prefix-stable). An assistant
#: message's `tool_calls` render exactly as the model writes them (plan, newline, `<tool_call>\n{"name": ...,
#: "arguments": ...}\n</tool_call>`): a server that re-renders the conversation from messages (the openai
#: backend) must show the model the same tokens as the runtime's verbatim turns, or it goes astray.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = 'You are a helpful assistant.' %}"
    "{%- set rest = messages %}{%- endif %}"
    "<|im_start|>system\n{{ system }}"
    "{%- if tools %}\n\n# Tools\n\nTo call a function, write a JSON object with its name and arguments "
    "between <tool_call></tool_call> tags. The functions:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>{%- endif %}<|im_end|>\n"
    "{%- for m in rest %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.content %}{{ m.content }}{%- endif %}"
    "{%- for call in (m.tool_calls or []) %}{%- set fn = call.function if call.function is defined else call %}"
    "{%- if m.content or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    "{\"name\": \"{{ fn.name }}\", \"arguments\": "
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (digits split one by one, so numbers copy digit by digit)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, model_max_length=8192)
    fast.add_tokens(MARKERS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode(renderer: object, tokenizer: Any, blocks: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of a conversation as the runtime lays them out, and a mask of the model's own tokens."""
    from agent.chat import ChatRenderer

    assert isinstance(renderer, ChatRenderer)
    tok = tokenizer
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    ids: list[int] = []
    mask: list[int] = []

    def put(text: str, framing: bool, learn: bool) -> None:
        piece = tok.encode(text, add_special_tokens=False, split_special_tokens=not framing)
        ids.extend(piece)
        mask.extend([int(learn)] * len(piece))

    renderer.truncate(0)
    for kind, text in blocks:
        if kind == "model_turn":
            put(renderer.turn_header(), True, False)
            put(text, True, True)
            ids.append(stop)
            mask.append(1)
            tail = renderer.turn_tail()
            put(tail[len("<|im_end|>"):], True, False)
            renderer.add_turn(text)
        else:
            for piece in renderer.add(kind, text, tool="tool"):
                put(piece.text, piece.framing, False)
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("agent/models/fixture"))
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=150.0, help="training time budget (without --steps)")
    parser.add_argument("--steps", type=int, help="train exactly this many steps (deterministic: same seed, same "
                                                  "weights on any machine speed); overrides --seconds")
    parser.add_argument("--vocab", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--init", type=Path, help="continue training this model directory (its tokenizer kept)")
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agent.chat import ChatRenderer

    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    tools = tool_manifests()
    convs = [conversation(rng) for _ in range(args.conversations)]
    corpus = [json.dumps(tools), CHAT_TEMPLATE] + [text for conv in convs[:400] for _, text in conv]
    tokenizer: Any
    if args.init is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.init), local_files_only=True)
    else:
        tokenizer = train_tokenizer(corpus, args.vocab)
    renderer = ChatRenderer(tokenizer, tools)
    data = [encode(renderer, tokenizer, conv) for conv in convs]
    longest = max(len(ids) for ids, _ in data)
    print(f"{len(data)} conversations, {sum(len(i) for i, _ in data)} tokens, longest {longest}, "
          f"vocab {len(tokenizer)}")

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384,  # type: ignore[call-arg]
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM.from_pretrained(str(args.init)) if args.init else LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    started = time.monotonic()
    step = 0
    batch = 4
    order = list(range(len(data)))

    def progress() -> float:
        """How far training is, 0..1: by steps when counted, else by the time budget."""
        return step / args.steps if args.steps else (time.monotonic() - started) / args.seconds

    while progress() < 1:
        rng.shuffle(order)
        for start in range(0, len(order), batch):
            elapsed = time.monotonic() - started
            if progress() >= 1:
                break
            cosine = 0.5 * (1 + math.cos(math.pi * progress()))
            lr = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * cosine)
            for group in optimizer.param_groups:
                group["lr"] = lr
            chosen = [data[i] for i in order[start:start + batch]]
            width = max(len(ids) for ids, _ in chosen)
            inputs = torch.full((len(chosen), width), int(config.pad_token_id or 0), dtype=torch.long)
            labels = torch.full((len(chosen), width), -100, dtype=torch.long)
            attention = torch.zeros((len(chosen), width), dtype=torch.long)
            for row, (ids, mask) in enumerate(chosen):
                inputs[row, :len(ids)] = torch.tensor(ids)
                attention[row, :len(ids)] = 1
                labels[row, :len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
            loss = model(input_ids=inputs, attention_mask=attention, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if step % 20 == 0:
                print(f"step {step} {elapsed:.0f}s loss {loss.item():.4f} lr {lr:.2e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out} after {step} steps")


if __name__ == "__main__":
    main()
