"""export.max_shard_bytes: the Hugging Face sharded layout (whole tensors per file, an index naming each tensor's
file), read back by Eyas's loaders and accepted by the folder check, every file under the limit."""

import json

import pytest
import torch

from eyas.errors import EyasError
from eyas.drafter import drafter_weights, load_drafter
from eyas.export.check import check_folder
from eyas.export.keys import SGLANG_KEYS
from eyas.export.sglang import write_sglang
from eyas.model.eagle3 import Eagle3Config, Eagle3DraftModel


def _model():
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=256, intermediate_size=700, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, target_hidden_size=256, vocab_size=3001, draft_vocab_size=1500)
    m = Eagle3DraftModel(cfg)
    ids = torch.arange(1500) * 2
    m.d2t.copy_(ids - torch.arange(1500))
    m.t2d[ids] = True
    return m


def test_sharded_export_round_trips_under_the_limit(tmp_path):
    m = _model()
    limit = 1 << 20
    write_sglang(tmp_path, drafter_weights(m, [1, 3, 5], "output_of_layer"),
                 {"num_hidden_layers": 8, "hidden_size": 256, "vocab_size": 3001}, max_shard_bytes=limit)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and all(f.stat().st_size <= limit for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == SGLANG_KEYS and set(index["weight_map"].values()) == {f.name for f in files}
    m2, dcfg = load_drafter(tmp_path, m.embed_tokens.weight.detach(), engine="sglang")
    assert dcfg.layer_ids("output_of_layer") == [1, 3, 5]
    for k, v in m.trainable_state_dict().items():
        want = v.bfloat16().float() if v.is_floating_point() else v
        assert torch.equal(m2.state_dict()[k], want), k
    rep = check_folder(tmp_path, None)
    assert not rep.errors("sglang"), rep.to_text()
    # re-export without shards leaves one file and no stale index
    write_sglang(tmp_path, drafter_weights(m, [1, 3, 5], "output_of_layer"), {})
    assert [f.name for f in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_a_tensor_over_the_limit_is_named(tmp_path):
    with pytest.raises(EyasError, match="lm_head.weight alone is .* over export.max_shard_bytes"):
        write_sglang(tmp_path, drafter_weights(_model(), [1, 3, 5], "output_of_layer"), {}, max_shard_bytes=600_000)
