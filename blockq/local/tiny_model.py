"""``blockq tiny-model DIR``: a small random-weight Llama checkpoint with a real tokenizer,
written offline in seconds, for tests and demos of the vLLM engine on any machine.

The tokenizer is Mistral-7B v0.1's SentencePiece model, the one ``mistral-common``
ships (32,000 pieces, Llama's format); the weights are random, so the text is noise but
the token counts, timings and engine behaviour (batching, KV cache, preemption) are real.
The default shape is the smallest vLLM's CPU attention runs well: 2 layers, hidden size
128, 2 heads of 64 (head sizes much under 64 are not supported there).

Needs ``torch``, ``transformers`` and ``protobuf`` (the SentencePiece conversion); the
vLLM environment (``make vllm``) has them.
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from blockq.text.tokenizer import mistral_v1_model_path


@dataclass(frozen=True)
class TinyModelShape:
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: must be a multiple of num_heads ({self.num_heads})")


# Named shapes. ``small`` is what the tests run (the engine's behaviour, cheaply); ``medium``
# is large enough that compute, not per-step overhead, sets a step's time on one CPU thread:
# a 512-token prefill chunk costs several times a 16-sequence decode step, so a latency
# model fitted to it must get the shape right, not just a constant (docs/engines.md).
SIZES = {
    "small": TinyModelShape(),
    "medium": TinyModelShape(num_layers=4, hidden_size=768, num_heads=12, intermediate_size=1536),
}


def write_tiny_model(out_dir: Path, shape: TinyModelShape = TinyModelShape()) -> Path:
    """Write the checkpoint (config, safetensors weights, tokenizer) to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

    tokenizer_model = mistral_v1_model_path()
    if tokenizer_model is None:
        raise RuntimeError("tiny-model: needs sentencepiece and mistral-common (the tokenizer model it ships)")
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_model, out_dir / "tokenizer.model")
    tokenizer = LlamaTokenizer.from_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    torch.manual_seed(shape.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads, max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
        torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tiny-model", help="write a small random-weight Llama checkpoint with a real tokenizer")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--size", choices=sorted(SIZES), default="small",
                   help="a named shape (small: what the tests run; medium: a step's time set by compute); "
                        "--layers / --hidden-size override it")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=TinyModelShape.max_position_embeddings)
    p.add_argument("--seed", type=int, default=TinyModelShape.seed)
    p.set_defaults(handler=_cmd_tiny_model)


def shape_from_args(args: argparse.Namespace) -> TinyModelShape:
    """The named ``--size``, with ``--layers`` / ``--hidden-size`` laid over it."""
    shape = replace(SIZES[args.size], max_position_embeddings=args.max_model_len, seed=args.seed)
    if args.layers is not None:
        shape = replace(shape, num_layers=args.layers)
    if args.hidden_size is not None:  # heads of 64, the size vLLM's CPU attention runs well
        shape = replace(shape, hidden_size=args.hidden_size, num_heads=max(1, args.hidden_size // 64),
                        intermediate_size=2 * args.hidden_size)
    return shape


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    started_s = time.monotonic()
    out_dir = write_tiny_model(args.out_dir, shape_from_args(args))
    print(f"tiny model in {out_dir} ({time.monotonic() - started_s:.1f} s)")
    return 0
