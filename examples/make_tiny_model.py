"""Write a tiny Llama-style model directory (config + tokenizer, no weights), made locally.

    python examples/make_tiny_model.py DIR [--layers 2] [--hidden 256] [--heads 8] [--vocab 1024]

For SGLang runs with ``--load-format dummy`` (random weights: nothing is read or downloaded):
``config.json`` (LlamaForCausalLM), ``generation_config.json``, and a byte-level BPE
tokenizer trained here on a fixed word list (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``) that ``transformers.AutoTokenizer`` loads offline. The same
arguments give the same files. Needs the ``tokenizers`` package (it comes with transformers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def corpus() -> list[str]:
    """The training text: the words of purlin's generated prompts, plus plain English sentences."""
    try:
        from purlin_sglang.bench.offline import WORDS
    except ImportError:  # run from a checkout without purlin_sglang installed
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from purlin_sglang.bench.offline import WORDS
    lines = [" ".join(WORDS[i:i + 12]) for i in range(0, len(WORDS), 12)]
    lines += ["The quick brown fox jumps over the lazy dog.", "What is the capital city of France?",
              "Hello, world! 0123456789 + - * / = ( ) [ ] { } < > : ; , . ? ! ' \""]
    return lines * 4


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def write_model(out: Path, layers: int = 2, hidden: int = 256, heads: int = 8, vocab: int = 1024,
                context: int = 4096) -> dict:
    """Write the model directory; returns its config.json contents."""
    if hidden % heads:
        raise ValueError(f"make_tiny_model: --hidden {hidden} must be a multiple of --heads {heads}")
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (PAD, BOS, EOS)}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads,
        "hidden_act": "silu", "max_position_embeddings": context, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": tok.get_vocab_size(),
        "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD],
        "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "model_max_length": context, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")
    return config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8, help="attention (and KV) heads: a multiple of the TP size")
    p.add_argument("--vocab", type=int, default=1024,
                   help="largest tokenizer vocabulary to train (the word list gives about 730)")
    args = p.parse_args(argv)
    if importlib.util.find_spec("tokenizers") is None:
        print("make_tiny_model: needs the 'tokenizers' package: pip install tokenizers", file=sys.stderr)
        return 2
    try:
        cfg = write_model(args.dir, args.layers, args.hidden, args.heads, args.vocab)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dir}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"{cfg['num_attention_heads']} heads, vocab {cfg['vocab_size']} (use --load-format dummy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
