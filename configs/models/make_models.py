"""Write the serving test models of configs/models/ (config + tokenizer, no weights), made locally.

    python configs/models/make_models.py            # rewrites configs/models/{llama-dense-8l,olmo-dense-8l,qwen3-moe-4l}
    python configs/models/make_models.py --check    # exit 1 if a committed file differs from what it writes

Both are served with ``--load-format dummy`` (SGLang's dummy loader: every parameter drawn from a generator
seeded with 1234, per parameter, so every run and every process gets the same weights for the same shard
shape; nothing is read or downloaded). The tokenizer is examples/make_tiny_model.py's byte-level BPE, trained
here on a fixed word list (about 730 tokens), with a small chat template for /v1/chat/completions; the
models' vocab_size is the tokenizer's, so every id the model can emit decodes.

- ``llama-dense-8l``: LlamaForCausalLM, hidden 4096, 32 attention heads, 8 KV heads (head_dim 128),
  intermediate 14336, 8 layers: Llama-3-8B's layer shape, 8 of its 32 layers (TP 1, 2, 4, 8).
- ``olmo-dense-8l``: OlmoForCausalLM (OLMo-1-7B's layer shape: hidden 4096, 32 heads, multi-head KV,
  intermediate 11008, SwiGLU, weightless LayerNorm), 8 layers. The dense model ``tools/gpu.sh serve`` serves:
  SGLang 0.5.23's Llama and Qwen2/3 MLPs import ``cutlass`` (nvidia-cutlass-dsl, for their DualGemm) on every
  CUDA start, and the carried wheel set has no cutlass (docs/SGLANG.md, "Serving on the GPU machine").
- ``qwen3-moe-4l``: Qwen3MoeForCausalLM, hidden 2048, 32 heads, 4 KV heads (head_dim 128), 4 layers, every
  layer sparse: 16 experts of intermediate 768, top-2, normalised top-k (Qwen3-30B-A3B's layer shape with
  16 of its 128 experts; 16 divides by TP/EP 2 and 4).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "examples"))

from make_tiny_model import BOS, EOS, PAD, make_tokenizer  # noqa: E402

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

MODELS = {
    "llama-dense-8l": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "bfloat16",
    },
    "olmo-dense-8l": {
        "architectures": ["OlmoForCausalLM"], "model_type": "olmo",
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 8,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "clip_qkv": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen3-moe-4l": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 16, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 4, "torch_dtype": "bfloat16",
    },
}


def write(out: Path, shape: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(1024)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (PAD, BOS, EOS)}
    config = {**shape, "vocab_size": tok.get_vocab_size(), "bos_token_id": ids[BOS], "eos_token_id": ids[EOS],
              "pad_token_id": ids[PAD]}
    dump = lambda name, obj: (out / name).write_text(json.dumps(obj, indent=2) + "\n")  # noqa: E731
    dump("config.json", config)
    dump("generation_config.json", {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]})
    dump("tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "model_max_length": config["max_position_embeddings"], "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE})
    dump("special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    return config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = p.parse_args(argv)
    if not args.check:
        for name, shape in MODELS.items():
            cfg = write(HERE / name, shape)
            print(f"wrote {HERE / name}: {cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, "
                  f"hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}")
        return 0
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in MODELS.items():
            write(Path(tmp) / name, shape)
            for f in sorted((Path(tmp) / name).iterdir()):
                have = HERE / name / f.name
                if not have.is_file() or have.read_bytes() != f.read_bytes():
                    bad.append(str(have))
    print("differs: " + ", ".join(bad) if bad else "configs/models: up to date")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
