"""Convert a llama2.c checkpoint (legacy ``.bin``) and its ``tokenizer.bin`` into a Hugging Face Llama folder.

Used by the tests to get a real, pretrained Llama target in seconds (``stories260K``: dim 64, 5 layers, vocab 512).

Source of the formats (karpathy/llama2.c):

* Checkpoint: ``export.py::legacy_export`` ("version 0"), read by ``run.c::read_checkpoint``. A header of 7
  little-endian int32 ``(dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len)``, where a negative
  ``vocab_size`` means the classifier is *not* shared with the embedding; then float32 tensors, each layer's
  tensor of one kind stacked before the next kind::

      token_embedding  (vocab, dim)
      rms_att          (n_layers, dim)
      wq               (n_layers, n_heads * head_size, dim)
      wk               (n_layers, n_kv_heads * head_size, dim)
      wv               (n_layers, n_kv_heads * head_size, dim)
      wo               (n_layers, dim, n_heads * head_size)
      rms_ffn          (n_layers, dim)
      w1               (n_layers, hidden_dim, dim)        -> mlp.gate_proj
      w2               (n_layers, dim, hidden_dim)        -> mlp.down_proj
      w3               (n_layers, hidden_dim, dim)        -> mlp.up_proj
      rms_final        (dim,)
      freq_cis_real    (seq_len, head_size // 2)          (unused: RoPE is recomputed, theta 10000)
      freq_cis_imag    (seq_len, head_size // 2)          (unused)
      wcls             (vocab, dim)                        only when vocab_size < 0 in the header

  with ``head_size = dim // n_heads``. llama2.c applies RoPE to interleaved pairs ``(x[2i], x[2i+1])``; Hugging Face
  Llama rotates halves (``rotate_half``), so the rows of ``wq``/``wk`` are permuted per head exactly as
  transformers' ``convert_llama_weights_to_hf.py`` (and llama2.c's own ``export.py::hf_export``) do.
  The versioned formats (v1/v2, magic ``0x616b3432`` "ak42") are not supported.
* Tokenizer: ``tokenizer.py::export``, read by ``run.c::build_tokenizer``. ``max_token_length`` (int32), then per
  token a float32 score, an int32 byte length and the UTF-8 bytes. The SentencePiece space marker ``'▁'`` was written
  as a plain space, and ``<s>``/``</s>`` as ``"\\n<s>\\n"``/``"\\n</s>\\n"``; both are mapped back here.

Output folder: ``config.json`` (``LlamaForCausalLM``, float32), ``model.safetensors`` (float32, written with
``safetensors.torch.save_file``; ``lm_head.weight`` only when untied), ``tokenizer.json`` (a Llama-2 style
SentencePiece BPE with byte fallback built with the ``tokenizers`` library), ``tokenizer_config.json`` (special
tokens and a minimal chat template with ``{% generation %}`` markers) and ``special_tokens_map.json``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import DataError

__all__ = ["Llama2cFormatError", "convert_llama2c", "read_llama2c_tokenizer", "CHAT_TEMPLATE"]

_HEADER = struct.Struct("<7i")
_V1_MAGIC = 0x616B3432  # "ak42": llama2.c export.py version1/version2 files

# Story model: no roles are shown. User (and system) turns are their plain content; an assistant turn is its
# content followed by EOS, wrapped in generation markers so `return_assistant_tokens_mask=True` works.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
)


class Llama2cFormatError(DataError, ValueError):
    """A llama2.c file has the wrong size, header or layout. The message names the file."""


def read_llama2c_tokenizer(path: Path) -> list[tuple[bytes, float]]:
    """Read a llama2.c ``tokenizer.bin``: a list of ``(token bytes, score)`` in id order, bytes exactly as stored.

    Raises :class:`Llama2cFormatError` (a ``ValueError``) naming the file if it is truncated or malformed.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise Llama2cFormatError(f"{path}: tokenizer file not found") from None
    if len(data) < 4:
        raise Llama2cFormatError(f"{path}: {len(data)} bytes, too short for a llama2.c tokenizer header")
    (max_len,) = struct.unpack_from("<i", data, 0)
    if max_len <= 0:
        raise Llama2cFormatError(f"{path}: max_token_length {max_len} must be positive (not a llama2.c tokenizer?)")
    out: list[tuple[bytes, float]] = []
    off = 4
    while off < len(data):
        if off + 8 > len(data):
            raise Llama2cFormatError(f"{path}: truncated record header for token {len(out)} at byte {off}")
        score, n = struct.unpack_from("<fi", data, off)
        off += 8
        if n < 0 or n > max_len or off + n > len(data):
            raise Llama2cFormatError(
                f"{path}: token {len(out)} at byte {off - 8} has length {n} (max_token_length {max_len}, "
                f"{len(data) - off} bytes left)"
            )
        out.append((data[off : off + n], float(score)))
        off += n
    if not out:
        raise Llama2cFormatError(f"{path}: no tokens")
    return out


def _read_checkpoint(path: Path) -> tuple[dict[str, int], bool, dict[str, np.ndarray]]:
    """Parse a legacy llama2.c checkpoint: (header fields, shared classifier, raw float32 arrays by name)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise Llama2cFormatError(f"{path}: checkpoint file not found") from None
    if len(data) < _HEADER.size:
        raise Llama2cFormatError(f"{path}: {len(data)} bytes, too short for the 28-byte llama2.c header")
    if struct.unpack_from("<I", data, 0)[0] == _V1_MAGIC:
        raise Llama2cFormatError(
            f"{path}: llama2.c versioned format (magic 'ak42'); only the legacy (version 0) format is supported"
        )
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = _HEADER.unpack_from(data, 0)
    shared = vocab > 0
    vocab = abs(vocab)
    h = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, vocab_size=vocab,
             seq_len=seq_len)
    if min(h.values()) <= 0:
        raise Llama2cFormatError(f"{path}: bad llama2.c header {h}: every field must be non-zero")
    if dim % n_heads or n_heads % n_kv or (dim // n_heads) % 2:
        raise Llama2cFormatError(
            f"{path}: bad llama2.c header {h}: need dim % n_heads == 0, n_heads % n_kv_heads == 0, even head size"
        )
    hs = dim // n_heads
    kv_dim = n_kv * hs
    shapes = [
        ("token_embedding", (vocab, dim)),
        ("rms_att", (n_layers, dim)),
        ("wq", (n_layers, n_heads * hs, dim)),
        ("wk", (n_layers, kv_dim, dim)),
        ("wv", (n_layers, kv_dim, dim)),
        ("wo", (n_layers, dim, n_heads * hs)),
        ("rms_ffn", (n_layers, dim)),
        ("w1", (n_layers, hidden, dim)),
        ("w2", (n_layers, dim, hidden)),
        ("w3", (n_layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("freq_cis_real", (seq_len, hs // 2)),
        ("freq_cis_imag", (seq_len, hs // 2)),
    ]
    if not shared:
        shapes.append(("wcls", (vocab, dim)))
    n_floats = sum(int(np.prod(s)) for _, s in shapes)
    expected = _HEADER.size + 4 * n_floats
    if len(data) != expected:
        raise Llama2cFormatError(
            f"{path}: {len(data)} bytes, but the llama2.c legacy header {h} (shared classifier: {shared}) "
            f"implies {expected} bytes; wrong file, truncated, or not the legacy format"
        )
    flat = np.frombuffer(data, dtype="<f4", offset=_HEADER.size)
    arrays: dict[str, np.ndarray] = {}
    off = 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        arrays[name] = flat[off : off + n].reshape(shape)
        off += n
    return h, shared, arrays


def _permute_rotary(w, n_heads: int):
    """Interleaved-pair RoPE rows (llama2.c / Meta) -> rotate-half rows (HF). Same as transformers' converter."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _build_tokenizer(pieces: list[tuple[str, float]]):
    """A Llama-2 style fast tokenizer (tokenizers.Tokenizer) from SentencePiece pieces and scores in id order."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    # Merges as transformers' SentencePiece->fast conversion derives them (generate_merges(vocab, vocab_scores)):
    # every split of a piece into two in-vocab pieces, ranked by the merged piece's score, best first.
    merges = []
    for piece, score in pieces:
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    merges = [(a, b) for a, b, _ in merges]

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=pieces[0][0], fuse_unk=True, byte_fallback=True))
    # Llama-2 (legacy) behaviour: add the dummy prefix, spaces become '▁'; no pre-tokenizer.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(pieces[i][0], special=True, normalized=False) for i in range(3)])
    bos = pieces[1][0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, 1)]
    )
    return tok


def _pieces_from_llama2c(tokens: list[tuple[bytes, float]], path: Path) -> list[tuple[str, float]]:
    if len(tokens) < 259:
        raise Llama2cFormatError(f"{path}: {len(tokens)} tokens; need at least 259 (<unk>, <s>, </s>, 256 bytes)")
    pieces: list[tuple[str, float]] = []
    for i, (b, score) in enumerate(tokens):
        if i == 0:
            text = "<unk>"
        elif i == 1:
            text = "<s>"
        elif i == 2:
            text = "</s>"
        elif i < 259:
            text = f"<0x{i - 3:02X}>"
            if b.decode("utf-8", "replace") != text:
                raise Llama2cFormatError(f"{path}: token {i} is {b!r}, expected byte token {text!r}")
        else:
            try:
                text = b.decode("utf-8").replace(" ", "▁")
            except UnicodeDecodeError:
                raise Llama2cFormatError(f"{path}: token {i} ({b!r}) is not valid UTF-8") from None
        pieces.append((text, score))
    seen: dict[str, int] = {}
    for i, (p, _) in enumerate(pieces):
        if p in seen:
            raise Llama2cFormatError(f"{path}: tokens {seen[p]} and {i} are both {p!r}")
        seen[p] = i
    return pieces


def convert_llama2c(checkpoint: Path, tokenizer: Path, out_dir: Path) -> Path:
    """Convert a llama2.c legacy checkpoint + ``tokenizer.bin`` into a Hugging Face Llama folder; return ``out_dir``.

    Args:
        checkpoint: llama2.c legacy (version 0) ``.bin`` as written by ``export.py::legacy_export`` and read by
            ``run.c``: 7 int32 header fields, then float32 tensors (layout in the module docstring).
        tokenizer: llama2.c ``tokenizer.bin`` (``tokenizer.py::export``); its vocabulary size must equal the
            checkpoint's.
        out_dir: created if missing; existing files of the same names are overwritten.

    The folder holds ``config.json`` (``LlamaForCausalLM``: hidden ``dim``, intermediate ``hidden_dim``, heads and
    KV heads from the header, ``max_position_embeddings = seq_len``, ``rope_theta`` 10000, ``rms_norm_eps`` 1e-5,
    ``tie_word_embeddings`` when the header's vocab size is positive, bos 1, eos 2), ``model.safetensors`` (all
    float32; e.g. ``model.layers.{i}.self_attn.q_proj.weight`` of shape ``(n_heads*head_size, dim)``, ``k_proj``
    ``(n_kv_heads*head_size, dim)``, ``mlp.gate_proj`` ``(hidden_dim, dim)``, ``mlp.down_proj`` ``(dim,
    hidden_dim)``; q/k rows permuted from llama2.c's interleaved RoPE layout to HF's rotate-half layout), and a
    fast tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with :data:`CHAT_TEMPLATE`,
    ``special_tokens_map.json``). Loading it with ``AutoModelForCausalLM``/``AutoTokenizer`` in float32 reproduces
    llama2.c ``run.c`` (encoder ids and greedy continuation).

    Raises:
        Llama2cFormatError: (a ``ValueError`` and :class:`eyas.errors.DataError`) naming the file when a file is
            missing, has a bad or versioned header, a size that does not match its header, or when the tokenizer is
            malformed or its vocabulary size differs from the checkpoint's.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    checkpoint, tokenizer, out_dir = Path(checkpoint), Path(tokenizer), Path(out_dir)
    h, shared, a = _read_checkpoint(checkpoint)
    tokens = read_llama2c_tokenizer(tokenizer)
    if len(tokens) != h["vocab_size"]:
        raise Llama2cFormatError(
            f"{tokenizer}: {len(tokens)} tokens, but checkpoint {checkpoint} has vocab_size {h['vocab_size']}"
        )
    pieces = _pieces_from_llama2c(tokens, tokenizer)

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(x, dtype=np.float32, copy=True)).contiguous()

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": t(a["token_embedding"]),
                                   "model.norm.weight": t(a["rms_final"])}
    for i in range(h["n_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = t(a["rms_att"][i])
        sd[p + "self_attn.q_proj.weight"] = _permute_rotary(t(a["wq"][i]), h["n_heads"]).contiguous()
        sd[p + "self_attn.k_proj.weight"] = _permute_rotary(t(a["wk"][i]), h["n_kv_heads"]).contiguous()
        sd[p + "self_attn.v_proj.weight"] = t(a["wv"][i])
        sd[p + "self_attn.o_proj.weight"] = t(a["wo"][i])
        sd[p + "post_attention_layernorm.weight"] = t(a["rms_ffn"][i])
        sd[p + "mlp.gate_proj.weight"] = t(a["w1"][i])
        sd[p + "mlp.down_proj.weight"] = t(a["w2"][i])
        sd[p + "mlp.up_proj.weight"] = t(a["w3"][i])
    if not shared:
        sd["lm_head.weight"] = t(a["wcls"])

    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=h["vocab_size"],
        hidden_size=h["dim"],
        intermediate_size=h["hidden_dim"],
        num_hidden_layers=h["n_layers"],
        num_attention_heads=h["n_heads"],
        num_key_value_heads=h["n_kv_heads"],
        head_dim=h["dim"] // h["n_heads"],
        hidden_act="silu",
        max_position_embeddings=h["seq_len"],
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=shared,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    cfg = config.to_diff_dict()  # like save_pretrained: no label maps and other defaults...
    cfg.update(  # ...but the architecture's numbers are always spelled out
        {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                                         "bos_token_id", "eos_token_id", "hidden_act")}
    )
    cfg["rope_theta"] = 10000.0  # also top-level, for readers that predate rope_parameters

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    tok = _build_tokenizer(pieces)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    tok_cfg = {
        # The generic fast class loads tokenizer.json as written (LlamaTokenizer would rebuild its pipeline).
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": h["seq_len"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
    return out_dir
