"""stories260K (llama2.c) -> Hugging Face Llama: the converted folder reproduces llama2.c's run.c exactly.

Golden values below came from karpathy/llama2.c run.c at commit 350e04fe35433e6d2941dce5a1f53308f87058eb, built with
``gcc -O2 run.c -lm`` and run as ``./run stories260K.bin -z tok512.bin -t 0 -n 60 -i "Once upon a time"``
(greedy; -n counts the 5 prompt positions, so 56 new tokens). The ids were printed by a throwaway copy of run.c
patched to log ``prompt_tokens`` and each sampled ``next``; no llama2.c code is part of this repository.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from eyas.targets.llama2c import convert_llama2c, read_llama2c_tokenizer  # noqa: E402

pytestmark = pytest.mark.e2e

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
MODEL_DIR = SHARED / "models" / "stories260K"
CKPT = MODEL_DIR / "stories260K.bin"
TOK = MODEL_DIR / "tok512.bin"

PROMPT = "Once upon a time"
# run.c encode(tokenizer, PROMPT, bos=1, eos=0): <s>, ' Once', ' upon', ' a', ' time'
GOLDEN_PROMPT_IDS = [1, 403, 407, 261, 378]
# run.c greedy (-t 0) tokens after the prompt.
GOLDEN_NEW_IDS = [
    432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292, 411, 322,
    265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267,
    337, 335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415,
]
# run.c's printed text for the whole sequence (prompt + continuation).
GOLDEN_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw "
    "a big, red ball. She wanted to play with it, but it was too high"
)

if not (CKPT.is_file() and TOK.is_file()):
    pytest.skip(f"stories260K not found under {MODEL_DIR}", allow_module_level=True)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return convert_llama2c(CKPT, TOK, tmp_path_factory.mktemp("stories260k_hf"))


@pytest.fixture(scope="module")
def tokenizer(hf_dir):
    return transformers.AutoTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def model(hf_dir):
    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return m.eval()


def test_folder_layout_and_config(hf_dir):
    names = {p.name for p in hf_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)  # no pickles
    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 172, 5)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (8, 4, 512)
    assert cfg.max_position_embeddings == 512
    assert cfg.rope_parameters["rope_theta"] == 10000.0
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings is True


def test_tokenizer_matches_run_c_encoder(tokenizer):
    assert tokenizer.encode(PROMPT) == GOLDEN_PROMPT_IDS
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (1, 2, 0)
    assert tokenizer.convert_ids_to_tokens([3, 258, 403]) == ["<0x00>", "<0xFF>", "▁Once"]


def test_greedy_generation_matches_run_c(model, tokenizer):
    enc = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=len(GOLDEN_NEW_IDS), min_new_tokens=len(GOLDEN_NEW_IDS)
        )
    ids = out[0].tolist()
    assert ids[: len(GOLDEN_PROMPT_IDS)] == GOLDEN_PROMPT_IDS
    assert ids[len(GOLDEN_PROMPT_IDS) :] == GOLDEN_NEW_IDS
    assert tokenizer.decode(ids, skip_special_tokens=True) == GOLDEN_TEXT


@pytest.mark.parametrize(
    "text",
    [
        "Once upon a time",
        "Hello, world! 12345 [x] ~",
        "  two  spaces\nnew line\ttab",
        "Café — naïve 日本語 🙂",  # characters outside the vocab: byte fallback
    ],
)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_byte_fallback_tokens(tokenizer):
    # '日' is not in the 512-token vocab: its UTF-8 bytes e6 97 a5 become byte tokens (id = byte + 3).
    ids = tokenizer.encode("日", add_special_tokens=False)
    assert ids[-3:] == [0xE6 + 3, 0x97 + 3, 0xA5 + 3]


def test_chat_template_assistant_mask(tokenizer):
    msgs = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": " there was a girl."}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert text == "<s>Once upon a time there was a girl.</s>"
    r = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = r["input_ids"], r["assistant_masks"]
    assert ids[: len(GOLDEN_PROMPT_IDS)] == GOLDEN_PROMPT_IDS and ids[-1] == 2
    assert mask == [0] * len(GOLDEN_PROMPT_IDS) + [1] * (len(ids) - len(GOLDEN_PROMPT_IDS))
    gen = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert gen == "<s>Once upon a time"


def test_reader_and_errors(tmp_path):
    toks = read_llama2c_tokenizer(TOK)
    assert len(toks) == 512 and toks[0] == (b"<unk>", 0.0) and toks[3][0] == b"<0x00>"
    bad = tmp_path / "truncated.bin"
    bad.write_bytes(CKPT.read_bytes()[:-4])
    with pytest.raises(ValueError, match="truncated.bin"):
        convert_llama2c(bad, TOK, tmp_path / "out")
    hdr = tmp_path / "badheader.bin"
    hdr.write_bytes(struct.pack("<7i", 64, 172, 5, 7, 4, 512, 512) + CKPT.read_bytes()[28:])
    with pytest.raises(ValueError, match="badheader.bin"):
        convert_llama2c(hdr, TOK, tmp_path / "out")
    badtok = tmp_path / "badtok.bin"
    badtok.write_bytes(TOK.read_bytes()[:-3])
    with pytest.raises(ValueError, match="badtok.bin"):
        convert_llama2c(CKPT, badtok, tmp_path / "out")


def test_untied_classifier(tmp_path, model):
    # Negative vocab_size in the header = separate classifier appended after freq_cis (export.py legacy_export).
    data = CKPT.read_bytes()
    emb = data[28 : 28 + 4 * 512 * 64]
    untied = tmp_path / "untied.bin"
    untied.write_bytes(struct.pack("<7i", 64, 172, 5, 8, 4, -512, 512) + data[28:] + emb)
    out = convert_llama2c(untied, TOK, tmp_path / "untied_hf")
    m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert m.config.tie_word_embeddings is False
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([GOLDEN_PROMPT_IDS])
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, model(ids).logits, rtol=0, atol=0)
