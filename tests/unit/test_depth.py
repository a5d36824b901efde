"""A draft of more than one decoder layer (``train.draft.num_hidden_layers``, as vLLM stacks them): TTT equals
drafting with the decode path at every step, layers added to a trained drafter start where it was, and the vLLM
export carries ``layers.1.*`` (the e2e test serves one in vLLM); SGLang, which loads one layer, is refused."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import draft_config, tiny_draft

from eyas.config import load_config
from eyas.drafter import drafter_weights, load_drafter
from eyas.errors import ConfigError, EyasError
from eyas.export.keys import VLLM_KEYS
from eyas.export.sglang import write_sglang
from eyas.export.vllm import write_vllm
from eyas.model.eagle3 import Eagle3DraftModel, KVCache, deepen


def _cfg(layers=2):
    return draft_config(hidden=24, intermediate=37, heads=4, kv_heads=2, head_dim=6, vocab=99, draft_vocab=31,
                        num_hidden_layers=layers)


def _shifted(ids):
    return torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)


@pytest.mark.parametrize("layers", [2, 3])
def test_ttt_steps_equal_chain_drafting(layers):
    """Step 0 over a sequence equals cached decoding in two pieces, and steps 1 and 2 at anchor t equal drafting
    two more tokens after t: every stacked layer attends to its own cached keys under the TTT mask."""
    torch.manual_seed(layers)
    m = Eagle3DraftModel(_cfg(layers)).eval()
    assert len(m.decoder_layers()) == layers
    T = 9
    ids, aux = torch.randint(0, 99, (1, T)), torch.randn(1, T, 72)
    with torch.no_grad():
        steps = m(ids, aux, ttt_steps=3)
        kv = KVCache()
        a = m.decode_step(_shifted(ids)[:, :5], aux[:, :5], torch.arange(5), kv, from_target=True)
        b = m.decode_step(_shifted(ids)[:, 5:], aux[:, 5:], torch.arange(5, T), kv, from_target=True)
        assert kv.k.shape == (1, layers * 2, T, 6)   # every layer's key heads side by side
        torch.testing.assert_close(torch.cat([a, b], 1), steps[0], atol=1e-5, rtol=1e-5)
        for t in range(T - 3):
            kv = KVCache()
            h0 = m.decode_step(_shifted(ids)[:, : t + 1], aux[:, : t + 1], torch.arange(t + 1), kv, from_target=True)
            h1 = m.decode_step(ids[:, t + 2: t + 3], h0[:, -1:], torch.tensor([t + 1]), kv, from_target=False)
            h2 = m.decode_step(ids[:, t + 3: t + 4], h1, torch.tensor([t + 2]), kv, from_target=False)
            torch.testing.assert_close(h1[0, 0], steps[1][0, t], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(h2[0, 0], steps[2][0, t], atol=1e-5, rtol=1e-5)


def test_the_second_layer_counts():
    """A stacked layer changes what the draft computes (a model that ignored it would pass the test above)."""
    torch.manual_seed(0)
    m = Eagle3DraftModel(_cfg(2)).eval()
    ids, aux = torch.randint(0, 99, (1, 7)), torch.randn(1, 7, 72)
    with torch.no_grad():
        before = m(ids, aux, ttt_steps=2)
        m.layers["1"].mlp.down_proj.weight.mul_(3)
        after = m(ids, aux, ttt_steps=2)
    assert all((x - y).abs().max() > 1e-3 for x, y in zip(before, after))


def test_deepened_draft_computes_the_same_and_learns():
    one = tiny_draft(_cfg(1), seed=1)
    with torch.no_grad():
        one.midlayer.mlp.down_proj.weight.normal_()
        one.d2t.copy_(torch.randint(0, 60, (31,)))
    deep = deepen(one, 3, seed=5)
    assert deep.config.num_hidden_layers == 3 and one.config.num_hidden_layers == 1
    assert torch.equal(deep.midlayer.mlp.down_proj.weight, one.midlayer.mlp.down_proj.weight)
    assert torch.equal(deep.d2t, one.d2t)
    ids, aux = torch.randint(0, 99, (2, 11)), torch.randn(2, 11, 72)
    with torch.no_grad():
        a, b = one(ids, aux, ttt_steps=3), deep(ids, aux, ttt_steps=3)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=0, atol=0)
    # the new layers' output maps get a gradient at once (the rest once those move off zero)
    sum(o.square().sum() for o in deep(ids, aux, ttt_steps=3)).backward()
    for i in ("1", "2"):
        assert deep.layers[i].mlp.down_proj.weight.grad.abs().sum() > 0
        assert deep.layers[i].self_attn.o_proj.weight.grad.abs().sum() > 0
        assert deep.layers[i].hidden_norm.weight.grad is None           # vLLM's unused norm: frozen
    assert torch.equal(deepen(one, 3, seed=5).layers["2"].self_attn.q_proj.weight, deep.layers["2"].self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="added, not removed"):
        deepen(deep, 2)


def test_vllm_export_round_trip_and_sglang_refused(tmp_path):
    m = tiny_draft(_cfg(2), seed=2, draft_ids=torch.arange(31) * 3)
    drafter = drafter_weights(m, [1, 3, 5], "output_of_layer")
    out = write_vllm(tmp_path / "vllm", drafter, {"eos_token_id": 2}, verifier="target")
    st = load_file(str(out / "model.safetensors"))
    stacked = {k for k in st if k.startswith("layers.1.")}
    assert set(st) - stacked == VLLM_KEYS and len(stacked) == 10
    assert st["layers.1.self_attn.q_proj.weight"].shape == (24, 24)        # H-wide input after the first layer
    assert json.loads((out / "config.json").read_text())["transformer_layer_config"]["num_hidden_layers"] == 2
    back, dcfg = load_drafter(out, m.embed_tokens.weight.detach())
    assert dcfg.draft.num_hidden_layers == 2
    torch.testing.assert_close(back.layers["1"].mlp.up_proj.weight, m.layers["1"].mlp.up_proj.weight.bfloat16().float())
    with pytest.raises(EyasError, match="SGLang's EAGLE-3 model loads exactly one"):
        write_sglang(tmp_path / "sglang", drafter, {})
    assert not (tmp_path / "sglang" / "config.json").exists()


def test_config_refuses_depth_with_sglang_export(tmp_path):
    base = {"target": {"model": "t"}, "prepare": {"sources": [{"path": "p.jsonl"}]},
            "train": {"draft": {"num_hidden_layers": 2}}}
    f = tmp_path / "c.yaml"
    f.write_text(json.dumps(base))
    with pytest.raises(ConfigError, match="SGLang's EAGLE-3 model loads one decoder layer"):
        load_config(f)
    f.write_text(json.dumps({**base, "export": {"formats": ["vllm"]}}))
    assert load_config(f).train.draft.num_hidden_layers == 2
