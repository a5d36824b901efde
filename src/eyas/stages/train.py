"""train: the EAGLE-3 draft with training-time test, offline from the store or online from the target.

The draft vocabulary and layer ids are read from the run (vocab stage, store header), never recomputed; with
``--init-from DRAFTER`` (``train.init_from``, any drafter folder :func:`eyas.drafter.read_drafter` reads) the
drafter's own d2t/t2d are kept, or with ``train.init_vocab: run`` replaced by the run's (its lm_head re-indexed,
:func:`eyas.model.eagle3.remap_draft_vocab`). ``train.mode: online`` runs the
target in this job to make each batch's states (rounded to ``extract.dtype``, as the store would hold them, so
offline and online train on the same numbers). Under ``torchrun`` every process runs this stage; process 0
writes. Writes ``train/checkpoints/step-*/``, ``train/metrics.jsonl``, ``train/tensorboard/`` and
``train/final/``, a drafter folder (:mod:`eyas.drafter`), from which export builds the engine folders.

``touch RUN/train/STOP`` ends training early but cleanly: after the step in progress it checkpoints and writes
``train/final`` as at the end of the schedule (the learning rate has not decayed then; the summary says
``stopped_on_request``). A STOP already there when the stage starts is a request too (one made while the target
loaded, or before a resume): it is honoured after the first step, and said so. The file is removed once a run has
stopped on it, so that the next start trains on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..data.vocab import load_vocab
from ..distributed import process_rank
from ..drafter import DrafterConfig, DrafterWeights, load_drafter, write_drafter
from ..errors import EyasError, StoreError
from ..families import text_config
from ..model.eagle3 import deepen, remap_draft_vocab, widen_mlp
from ..records import read_tokenized
from ..store import HiddenStateStore
from ..store.header import expected_header
from ..summaries import TrainSummary
from ..targets.load import load_target_head, read_target_config, resolve_device
from ..train.build import build_draft, draft_config_for
from ..train.data import SampleDataset, split_held_out
from ..train.loop import stored_states, train
from ..train.metrics import summarise_metrics
from ..train.online import OnlineStates
from . import RunContext

# extract: online training captures with the extract stage's backend and dtypes; the store header names its layers
READS = ("train", "target", "extract")
INPUTS = ("tokenize", "vocab", "extract")


def reads_target_weights(cfg) -> bool:
    """The target's embedding and lm_head (both modes; online training loads the whole target too)."""
    return True


def required_inputs(cfg) -> tuple[str, ...]:
    """Online training reads no store: the extract stage is not needed then."""
    return INPUTS if cfg.train.mode == "offline" else tuple(s for s in INPUTS if s != "extract")


def preflight(ctx: RunContext) -> None:
    """Before anything is written: offline, the store was made by this run with this configuration (its header
    against the one this config expects: run id, target, tokenizer, layer ids, dtypes) and every shard is whole
    (size and header against the manifest); sample bytes are re-hashed as they are read. Raises
    :class:`StoreError`."""
    if ctx.cfg.train.mode != "offline":
        return
    store = HiddenStateStore.open(ctx.run.store)
    expected = expected_header(ctx.cfg.target, ctx.cfg.extract, ctx.run)
    diff = [k for k, v in expected.identity().items() if store.header.identity().get(k) != v]
    if diff:
        detail = "; ".join(f"{k}: store {store.header.identity().get(k)!r}, this run {expected.identity()[k]!r}"
                           for k in diff)
        raise StoreError(f"{store.root} holds hidden states of another run or configuration ({detail}): refusing "
                         f"to train on them. Rebuild it with `eyas extract CONFIG --force`")
    store.check_structure()


def run(ctx: RunContext) -> TrainSummary:
    cfg = ctx.cfg.train
    out = ctx.run.stage("train")
    target_cfg = read_target_config(ctx.cfg.target)
    embed, lm_head = load_target_head(ctx.cfg.target)
    samples = read_tokenized(ctx.run.tokenized)
    if cfg.mode == "offline":
        store = HiddenStateStore.open(ctx.run.store)
        header = store.header
        dataset = SampleDataset(samples, cfg.max_length, store)
        states = stored_states
    else:
        header = expected_header(ctx.cfg.target, ctx.cfg.extract, ctx.run)
        dataset = SampleDataset(samples, cfg.max_length)
        states = OnlineStates(ctx.cfg.target, ctx.cfg.extract, header.layer_ids, samples)
    layer_ids = header.layer_ids
    if cfg.init_from:
        # an engine folder's layers as SGLang reads them: eagle_config ids are output_of_layer (its own convention)
        model, theirs = load_drafter(Path(cfg.init_from).expanduser(), embed, engine="sglang",
                                     num_target_layers=int(text_config(target_cfg)["num_hidden_layers"]))
        dcfg, their_layers = model.config, theirs.layer_ids(header.layer_convention)
        if list(their_layers) != list(layer_ids):
            raise EyasError(f"train.init_from: {cfg.init_from} was trained on aux layers {their_layers}, this run "
                            f"captures {layer_ids} ({header.layer_convention}); they must match")
        if dcfg.vocab_size != int(embed.shape[0]) or dcfg.target_hidden_size != int(embed.shape[1]):
            raise EyasError(f"train.init_from: {cfg.init_from} was made for a target of vocabulary "
                            f"{dcfg.vocab_size} / hidden {dcfg.target_hidden_size}, this target has "
                            f"{embed.shape[0]} / {embed.shape[1]}")
        if cfg.init_vocab == "run":
            model = _onto_run_vocab(ctx, model, lm_head)
        else:
            ctx.log(f"[eyas] train: fine-tuning {cfg.init_from} (its draft vocabulary of {dcfg.draft_vocab_size} "
                    f"kept; the run's vocab stage is not used: train.init_vocab=run trains over the run's)")
        model = _grow_to_asked_shape(model, cfg, ctx.log)
        dcfg = model.config
    else:
        d2t, t2d = load_vocab(ctx.run.vocab)
        dcfg = draft_config_for(target_cfg, cfg.draft, len(d2t), len(layer_ids))
        model = build_draft(dcfg, embed, d2t, t2d, cfg.seed)
    if cfg.mode == "offline" and header.topk:
        _check_label_vocab(ctx, model, header)
    train_idx, held_idx = split_held_out(len(dataset), min(cfg.eval_samples, len(dataset) - 1), cfg.seed)
    train_set, held_out = dataset.subset(train_idx), (dataset.subset(held_idx) if held_idx else None)
    if not len(train_set):  # the loop divides by the batches of an epoch
        raise EyasError(f"train: no training sample ({len(samples)} tokenized, {len(held_idx)} held out); the "
                        f"stages before it produced nothing to train on")
    device = resolve_device(cfg.device)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ctx.log(f"[eyas] train ({cfg.mode}): {len(train_set)} samples ({len(held_idx)} held out), draft "
            f"{n_params / 1e6:.1f}M trainable parameters, TTT {cfg.ttt_steps} steps, device {device}")
    stop_file = ctx.run.train_stop
    if stop_file.exists():   # never removed here: a request made while this stage loaded would be lost
        ctx.log(f"[eyas] train: {stop_file} is there (a stop asked for before training started): training stops "
                f"after its next step and writes its drafter; remove the file to train on")
    result = train(model, train_set, lm_head, cfg, out, device, ctx.fingerprint, log=ctx.log,
                   states=states, held_out=held_out, should_stop=lambda step: stop_file.exists())
    import torch.distributed as tdist

    summary = _write_final(ctx, result, dcfg, layer_ids, header, n_params) if result.final_state else None
    if summary is not None:
        summary.stopped_on_request = stop_file.exists() and not result.stopped_early
    if tdist.is_initialized():  # every process returns process 0's summary (each writes the same done.json)
        box = [summary]
        tdist.broadcast_object_list(box, src=0)
        summary = box[0]
    if summary is not None and summary.stopped_on_request and process_rank() == 0:
        stop_file.unlink(missing_ok=True)   # honoured: the next start (a resume, a longer schedule) trains on
    return summary


def _onto_run_vocab(ctx: RunContext, model, lm_head):
    """``train.init_vocab: run``: the ``init_from`` drafter moved onto the run's draft vocabulary
    (:func:`eyas.model.eagle3.remap_draft_vocab`), saying how many rows were kept, started new and dropped.

    Raises :class:`EyasError` when the two vocabularies share too few ids for the fit."""
    d2t, t2d = load_vocab(ctx.run.vocab)
    if torch.equal(d2t, model.d2t.cpu()):
        ctx.log(f"[eyas] train: fine-tuning {ctx.cfg.train.init_from}; its draft vocabulary is the run's "
                f"({len(d2t)} ids)")
        return model
    try:
        model, r = remap_draft_vocab(model, d2t, t2d, lm_head)
    except ValueError as e:
        raise EyasError(f"train.init_vocab=run: {ctx.cfg.train.init_from} cannot be moved onto {ctx.run.vocab}: "
                        f"{e}; keep its vocabulary (train.init_vocab=drafter) or train from scratch") from None
    ctx.log(f"[eyas] train: fine-tuning {ctx.cfg.train.init_from} over the run's draft vocabulary ({len(d2t)} ids, "
            f"train.init_vocab=run): {r.kept} lm_head rows kept, {r.new} new ones started from the target's head "
            f"(least-squares fit over the kept ids, cosine {r.fit_cosine} on held-out ones), {r.dropped} of the "
            f"drafter's ids dropped")
    return model


def _check_label_vocab(ctx: RunContext, model, header) -> None:
    """A top-k store's labels are distributions over the draft vocabulary they were made with: the draft must
    predict over the same one. Raises :class:`EyasError` naming both when it does not (a ``train.init_from``
    drafter keeps its own vocabulary)."""
    import torch

    d2t, _ = load_vocab(ctx.run.vocab)
    if len(d2t) != header.draft_vocab_size or not torch.equal(model.d2t.cpu(), d2t):
        where = f"train.init_from: {ctx.cfg.train.init_from}" if ctx.cfg.train.init_from else "the draft"
        raise EyasError(f"{where} predicts over another draft vocabulary ({len(model.d2t)} ids) than the one "
                        f"{ctx.run.store}'s top-{header.label_topk} labels are made over ({header.draft_vocab_size} "
                        f"ids, {ctx.run.vocab}): train from the run's vocabulary (no init_from), or extract with "
                        f"extract.labels: hidden (the last hidden state, from which any vocabulary's labels follow)")


def _grow_to_asked_shape(model, cfg, log):
    """``train.draft`` beside ``train.init_from``: a field equal to the drafter's is fine; a larger
    ``intermediate_size`` widens the MLP function-preservingly (:func:`eyas.model.eagle3.widen_mlp`), a larger
    ``num_hidden_layers`` adds layers likewise (:func:`eyas.model.eagle3.deepen`); any other difference is refused
    (a user-given value is never replaced silently).

    Raises :class:`EyasError` naming the fields that differ."""
    asked = {k: v for k, v in cfg.draft.model_dump().items() if v is not None}
    have = model.config.to_dict()
    wider = asked.pop("intermediate_size", have["intermediate_size"])
    deeper = asked.pop("num_hidden_layers", have["num_hidden_layers"])
    differ = {k: (v, have[k]) for k, v in asked.items() if have.get(k) != v}
    if wider < have["intermediate_size"]:
        differ["intermediate_size"] = (wider, have["intermediate_size"])
    if deeper < have["num_hidden_layers"]:
        differ["num_hidden_layers"] = (deeper, have["num_hidden_layers"])
    if differ:
        raise EyasError("train.init_from: " + str(cfg.init_from) + " has another draft shape than train.draft asks: "
                        + "; ".join(f"train.draft.{k}: {v} asked, the drafter has {h}" for k, (v, h) in differ.items())
                        + ". Fine-tuning keeps a drafter's shape, except that intermediate_size and num_hidden_layers "
                        "may grow (the MLP is widened or layers added, its outputs unchanged at the start); unset "
                        "these fields or train from scratch")
    if wider > have["intermediate_size"]:
        log(f"[eyas] train: widening the drafter's MLP from {have['intermediate_size']} to {wider} channels "
            f"(train.draft.intermediate_size; new channels start with zero output, so it starts as it was)")
        model = widen_mlp(model, wider, cfg.seed)
    if deeper > have["num_hidden_layers"]:
        log(f"[eyas] train: adding decoder layers to the drafter, {have['num_hidden_layers']} -> {deeper} "
            f"(train.draft.num_hidden_layers; each new layer starts with zero output, so it starts as it was)")
        model = deepen(model, deeper, cfg.seed)
    return model


def _write_final(ctx: RunContext, result, dcfg, layer_ids, header, n_params: int) -> TrainSummary:
    """``train/final`` (a drafter folder) and the stage summary; process 0 only."""
    cfg = ctx.cfg.train
    write_drafter(ctx.run.drafter, DrafterWeights(
        DrafterConfig(draft=dcfg, aux_layer_ids=layer_ids, layer_convention=header.layer_convention,
                      own_embedding=dcfg.own_embedding, target=header.target, ttt_steps=cfg.ttt_steps),
        result.final_state))
    summary = summarise_metrics(ctx.run.train_metrics, cfg.ttt_steps)
    summary.update(trainable_parameters=n_params, steps=result.steps, mode=cfg.mode,
                   tokens_per_s=round(result.final_metrics.get("tokens_per_s", 0.0), 1),
                   stopped_early=result.stopped_early, fp8=result.fp8.recipe, fp8_lm_head=result.fp8_lm_head)
    if result.fp8.fallback:
        summary.update(fp8_fallback=result.fp8.fallback)
    return TrainSummary(**summary)
