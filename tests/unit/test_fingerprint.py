"""Stage fingerprints: a stage's hash covers the config it reads and what its inputs were made with, nothing else.
(tests/e2e/test_fingerprints.py checks the declarations against what each stage really reads.)"""

from eyas.config import RunConfig
from eyas.io import stable_hash
from eyas.stages import dependencies, stage_fingerprint

BASE = {"run_dir": "runs/x", "target": {"model": "some/folder"}, "prepare": {"sources": [{"path": "a.jsonl"}]}}


def _with(cfg: RunConfig, section: str, **fields) -> RunConfig:
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=fields)})


def test_generate_fingerprint_covers_the_chat_template_arguments():
    """generate renders its prompts with tokenize.chat_template_kwargs: replies made under another template must
    not be reused (issue 14: they were)."""
    cfg = RunConfig.model_validate(BASE)
    thinking_off = _with(cfg, "tokenize", chat_template_kwargs={"enable_thinking": False})
    assert stage_fingerprint(cfg, "generate") != stage_fingerprint(thinking_off, "generate")
    # tokenize.max_length is generate's default prompt limit (turns past it are not generated): covered too
    longer = _with(cfg, "tokenize", max_length=4096)
    assert stage_fingerprint(cfg, "generate") != stage_fingerprint(longer, "generate")
    assert stage_fingerprint(cfg, "tokenize") != stage_fingerprint(longer, "tokenize")
    # the vocabulary does not make replies: generate is kept
    assert stage_fingerprint(cfg, "generate") == stage_fingerprint(_with(cfg, "vocab", draft_vocab_size=99), "generate")


def test_fingerprints_follow_the_inputs_and_skip_neutral_fields():
    cfg = RunConfig.model_validate(BASE)
    assert stage_fingerprint(_with(cfg, "train", lr=3e-4), "export") != stage_fingerprint(cfg, "export")
    assert stage_fingerprint(_with(cfg, "train", lr=3e-4), "extract") == stage_fingerprint(cfg, "extract")
    assert stage_fingerprint(_with(cfg, "vocab", draft_vocab_size=99), "extract") == stage_fingerprint(cfg, "extract")
    # where a stage runs and how often it logs do not change its output
    assert stage_fingerprint(_with(cfg, "train", device="cpu", log_every=1), "train") == stage_fingerprint(cfg, "train")
    assert stage_fingerprint(_with(cfg, "target", device="cuda:1"), "prepare") == stage_fingerprint(cfg, "prepare")


def test_section_fingerprints_keep_their_format():
    """A stage whose dependencies are whole sections hashes them as before (training checkpoints hold the train
    fingerprint: a changed format would refuse to resume them)."""
    cfg = RunConfig.model_validate(BASE)
    deps = dependencies("train")
    assert deps == ("extract", "generate", "prepare", "target", "tokenize", "train", "vocab")
    target = cfg.target.model_dump(mode="json")
    train = cfg.train.model_dump(mode="json")
    for k in ("device", "cache_dir"):
        target.pop(k)
    for k in ("device", "log_every", "loader_workers"):   # where and how fast, not what
        train.pop(k)
    for k in ("fp8", "init_vocab", "fp8_lm_head"):   # added later: left out at their defaults (the behaviour before)
        train.pop(k)
    train["draft"].pop("num_hidden_layers")
    extract = cfg.extract.model_dump(mode="json")
    for k in ("ignore_disk_space", "labels", "label_topk", "label_mass"):
        extract.pop(k)
    fp = stage_fingerprint(cfg, "train")
    assert fp["target"] == stable_hash(target) and fp["train"] == stable_hash(train)
    assert fp["vocab"] == stable_hash(cfg.vocab.model_dump(mode="json"))
    assert fp["extract"] == stable_hash(extract)


def test_fields_added_later_keep_older_fingerprints_until_set():
    """train.fp8, train.init_vocab, train.fp8_lm_head, train.draft.num_hidden_layers and extract.labels (with label_topk, label_mass) came after stores and checkpoints
    were made: at their defaults they are not hashed, so those stay current; set, they change the fingerprint as any
    field."""
    cfg = RunConfig.model_validate(BASE)
    assert stage_fingerprint(_with(cfg, "train", fp8="tensorwise"), "train") != stage_fingerprint(cfg, "train")
    assert stage_fingerprint(_with(cfg, "train", init_vocab="run"), "train") != stage_fingerprint(cfg, "train")
    assert stage_fingerprint(_with(cfg, "train", fp8_lm_head=True), "train") != stage_fingerprint(cfg, "train")
    deeper = cfg.model_copy(update={"train": cfg.train.model_copy(update={"draft": cfg.train.draft.model_copy(
        update={"num_hidden_layers": 2})})})
    assert stage_fingerprint(deeper, "train") != stage_fingerprint(cfg, "train")
    topk = _with(cfg, "extract", labels="topk")
    assert stage_fingerprint(topk, "extract") != stage_fingerprint(cfg, "extract")
    assert stage_fingerprint(_with(topk, "extract", label_topk=64), "extract") != stage_fingerprint(topk, "extract")


def test_self_prompt_system_prompts_and_tokenize_workers():
    """prepare.self_prompts.system_prompts came after prepared folders existed: unset, the prepare fingerprint is
    the hash it had before (the nested field left out); set, it changes. tokenize.workers changes no output."""
    cfg = RunConfig.model_validate({**BASE, "prepare": {"sources": [], "self_prompts": {"count": 10}}})
    prepare = cfg.prepare.model_dump(mode="json")
    prepare["self_prompts"].pop("system_prompts")
    assert stage_fingerprint(cfg, "prepare")["prepare"] == stable_hash(prepare)
    steered = cfg.model_copy(update={"prepare": cfg.prepare.model_copy(update={
        "self_prompts": cfg.prepare.self_prompts.model_copy(update={"system_prompts": [None, "Write poems."]})})})
    assert stage_fingerprint(steered, "prepare") != stage_fingerprint(cfg, "prepare")
    assert stage_fingerprint(_with(cfg, "tokenize", workers=4), "tokenize") == stage_fingerprint(cfg, "tokenize")
