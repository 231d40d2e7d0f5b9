"""configs/models/: the committed dummy models are what make_models.py writes, small, and fit TP 1-4 (8 dense)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def test_committed_models_match_the_generator():
    r = subprocess.run([sys.executable, str(MODELS / "make_models.py"), "--check"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", ["llama-dense-8l", "olmo-dense-8l", "qwen3-moe-4l"])
def test_model_shapes_fit_the_tp_sizes(name):
    d = MODELS / name
    cfg = json.loads((d / "config.json").read_text())
    assert sum(f.stat().st_size for f in d.iterdir()) < 300_000
    tok = json.loads((d / "tokenizer.json").read_text())
    assert cfg["vocab_size"] == len(tok["model"]["vocab"]) + len(
        [t for t in tok["added_tokens"] if t["content"] not in tok["model"]["vocab"]])
    tps = (1, 2, 4) if "moe" in name else (1, 2, 4, 8)
    for tp in tps:
        assert cfg["num_attention_heads"] % tp == 0 and cfg["num_key_value_heads"] % tp == 0, (name, tp)
    if "moe" in name:
        assert cfg["num_experts"] % 4 == 0 and cfg["num_experts_per_tok"] == 2
        assert cfg["moe_intermediate_size"] % 4 == 0
    assert "chat_template" in json.loads((d / "tokenizer_config.json").read_text())
