"""capture.mode=offline in the training loop: the examples and features of a `drafttrain capture` directory
(``offline_data``), the checks that they fit this run (``check_store``), and a micro-batch's capture from the
stored features (``capture_batch``; online, the method's own capture forward). The target given to the
method is load_target_parts's: embeddings, final norm, lm_head and the first ``target_layers(cfg)`` decoder
layers are loaded, the other layers stay on the meta device; the whole target is loaded after training to
evaluate."""
from __future__ import annotations

from ..io import DraftTrainError
from .method import refuse_offline


def offline_data(job, tname: str):
    """capture.mode=offline: the examples (and later their features) from a `drafttrain capture` directory;
    evaluation prompts from ``data`` as usual."""
    from ..capture.store import FeatureStore
    from ..data.select import eval_conversations

    c = job.capture
    if not c.path:
        raise DraftTrainError("capture.mode=offline needs capture.path=<directory written by drafttrain capture>")
    store = FeatureStore(c.path, verify=c.verify)
    from ..identity import same_target

    if not same_target(store.meta.get("target_id") or store.meta.get("target"), tname):
        raise DraftTrainError(f"capture.path={c.path}: captured from target {store.meta.get('target')}, but this run's "
                              f"target is {tname}")
    examples = store.examples()
    stats = {"rows": len(examples), "tokens": store.num_tokens, "offline_features": str(c.path),
             "trainable_tokens": sum(sum(ex["loss_mask"]) for ex in examples)}
    return store, examples, eval_conversations(job.data, tname), stats


def check_store(store, method, job) -> None:
    refuse_offline(job, type(method))
    needs = method.offline_features
    missing = [n for n in needs if n not in store.features]
    if missing:
        raise DraftTrainError(f"capture.path={job.capture.path}: lacks {', '.join(missing)} needed by method="
                              f"{job.method} (captured for method={store.meta.get('method')})")
    if "taps" in needs and list(store.meta.get("taps") or []) != list(getattr(method, "taps", [])):
        raise DraftTrainError(f"capture.path={job.capture.path}: captured taps {store.meta.get('taps')}, this run's "
                              f"eagle3 taps are {list(method.taps)}")


def capture_batch(method, model, mb, store, idx, examples):
    """Online: the target runs on the micro-batch. Offline: the stored features of its examples."""
    if store is None:
        return method.capture(model, mb)
    from ..data.packing import pack_features

    packed = "slots" in mb
    if packed:
        spans = [(r, c) for r, c in mb["slots"].tolist()]  # (row, first column) of each example
        lengths = [int(((mb["doc_ids"][r] == mb["doc_ids"][r, c]) & (mb["attention_mask"][r] > 0)).sum())
                   for r, c in spans]
    else:
        lengths = mb["attention_mask"].sum(1).tolist()
        spans = [(b, 0) for b in range(len(lengths))]
    for b, i in enumerate(idx):  # stored features belong to the stored rows: refuse rewritten (on-policy) rows
        r, c = spans[b] if b < len(spans) else (0, 0)
        if b >= len(lengths) or lengths[b] != len(examples[i]["input_ids"]) or \
                mb["input_ids"][r, c: c + lengths[b]].tolist() != examples[i]["input_ids"]:
            raise DraftTrainError("capture.mode=offline: the method rewrote the training rows (on-policy data?); "
                                  "stored features cannot match them: use capture.mode=online")
    device = mb["input_ids"].device
    if not packed:
        return method.capture_from_features(model, mb, store.batch(idx, mb["input_ids"].shape[1],
                                                                   method.offline_features, device=device))
    feats = store.batch(idx, max(lengths), method.offline_features, device=device)
    return method.capture_from_features(model, mb, {k: pack_features(v, lengths, mb) for k, v in feats.items()})
