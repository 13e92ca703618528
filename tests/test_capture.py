"""Offline capture: the feature store (format, checksums, shapes, resume) and training from it."""
from __future__ import annotations

import json

import pytest
import torch

from drafttrain.capture import store as S
from drafttrain.capture.capture import run_capture
from drafttrain.capture.store import FeatureStore
from drafttrain.io import DraftTrainError

from .test_distributed import capture_run, history, reference_run, zero2_offline_run


@pytest.fixture(scope="module")
def setup(tiny_builtin_target):
    torch.set_num_threads(1)
    from drafttrain.config import Eagle3Config, TargetConfig
    from drafttrain.data.builtin import builtin_conversations
    from drafttrain.data.chat import tokenize_conversations
    from drafttrain.targets.load import load_target
    from drafttrain.training.eagle3 import Eagle3Method

    model, tok, path = load_target(TargetConfig(name_or_path=str(tiny_builtin_target)))
    examples, _ = tokenize_conversations(tok, builtin_conversations("draft", 12, 0), 96, "truncate")
    method = Eagle3Method(Eagle3Config(ttt_steps=2), tok, model)
    return model, tok, examples, method


def _capture(setup, out, **kw):
    model, tok, examples, method = setup
    args = dict(method="eagle3", taps=method.taps, dtype="float32", batch_size=4, shard_mb=0.4, target_name="t",
                pad_id=tok.pad_token_id, progress=False, say=lambda m: None)
    args.update(kw)
    return run_capture(model, examples, out, **args)


def test_store_holds_the_online_capture(setup, tmp_path):
    from drafttrain.data.chat import collate

    model, tok, examples, method = setup
    stats = _capture(setup, tmp_path / "f")
    fs = FeatureStore(tmp_path / "f", verify="full")
    n_shards = len(fs.records)
    assert stats["shards_written"] == n_shards > 1 and len(fs) == len(examples)
    assert fs.examples() == examples  # example i of the store is example i of the data
    H = model.config.hidden_size
    assert fs.features == {"taps": 3 * H, "last_hidden": H}
    idx = [3, 0, 7]
    mb = collate([examples[i] for i in idx], tok.pad_token_id)
    online = method.capture(model, mb)
    offline = method.capture_from_features(model, mb, fs.batch(idx, mb["input_ids"].shape[1]))
    real = mb["attention_mask"].bool()
    assert torch.allclose(offline.taps[real], online.taps[real], atol=1e-5)
    assert torch.allclose(offline.logits[real], online.logits[real], atol=1e-4)
    assert (offline.taps[~real] == 0).all()  # padding stays padding
    # every shard's record matches its file
    for rec in fs.records:
        assert rec["sha256"] == S.sha256_file(tmp_path / "f" / rec["file"])
        assert rec["tensors"]["taps"] == {"shape": [rec["tokens"], 3 * H], "dtype": "F32"}


def test_bf16_storage_size_and_closeness(setup, tmp_path):
    """bf16: 8·H bytes of hidden states per token (+4 id, +1 mask); the loss barely moves."""
    from drafttrain.data.chat import collate
    from drafttrain.training.eagle3 import Eagle3Method  # noqa: F401

    model, tok, examples, method = setup
    _capture(setup, tmp_path / "b", dtype="bfloat16")
    fs = FeatureStore(tmp_path / "b")
    H = model.config.hidden_size
    assert fs.meta["bytes_per_token"] == 8 * H + 5
    on_disk = fs.index["bytes"] / fs.num_tokens
    assert 8 * H + 5 <= on_disk < 8 * H + 5 + 60, on_disk  # shard headers and offsets only
    print(f"bf16 capture: {on_disk:.1f} bytes/token on disk, H={H} (8H = {8 * H})")
    torch.manual_seed(0)
    drafter = method.build_drafter(model, examples, "t")
    idx = list(range(6))
    mb = collate([examples[i] for i in idx], tok.pad_token_id)
    losses = []
    for cap in (method.capture(model, mb), method.capture_from_features(model, mb, fs.batch(idx, mb["input_ids"].shape[1]))):
        counts = method.count_valid(drafter, mb, cap)
        loss, _ = method.loss(drafter, drafter, mb, cap, counts, 1.0)
        losses.append(float(loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)


def interrupt_after_shards(monkeypatch, n: int) -> list[int]:
    """Make the capture stop (KeyboardInterrupt) when it starts writing shard n+1; returns the shards written
    (``monkeypatch.undo()`` restores the writer)."""
    real_write = S.write_shard
    calls = []

    def crash(*a, **kw):
        if len(calls) == n:
            raise KeyboardInterrupt("simulated interruption")
        calls.append(a[1])
        return real_write(*a, **kw)

    monkeypatch.setattr(S, "write_shard", crash)
    return calls


def test_interrupted_capture_resumes_without_redoing_shards(setup, tmp_path, monkeypatch):
    out = tmp_path / "r"
    calls = interrupt_after_shards(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        _capture(setup, out)
    monkeypatch.undo()
    assert not (out / S.INDEX).exists()  # not usable until complete
    with pytest.raises(DraftTrainError, match="incomplete"):
        FeatureStore(out)
    first = {k: (out / S.shard_name(k)).stat().st_mtime_ns for k in calls}
    stats = _capture(setup, out)
    assert stats["shards_skipped"] == 2 and stats["shards_written"] == len(FeatureStore(out).records) - 2
    assert {k: (out / S.shard_name(k)).stat().st_mtime_ns for k in calls} == first  # not rewritten
    assert sorted(p.name for p in out.glob("shard-*.safetensors")) == \
        [S.shard_name(k) for k in range(len(FeatureStore(out).records))]  # no duplicates, no leftovers
    fresh = tmp_path / "fresh"  # an uninterrupted capture holds the same tensors (the header's metadata
    _capture(setup, fresh)      # order, hence the file's sha256, may differ)
    from safetensors.torch import load_file

    for rec in FeatureStore(out).records:
        a, b = load_file(out / rec["file"]), load_file(fresh / rec["file"])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rec["file"]


def test_corrupt_or_misshapen_shard_is_refused(setup, tmp_path):
    out = tmp_path / "c"
    _capture(setup, out)
    victim = out / S.shard_name(1)
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside the tensor data: same size, valid header
    victim.write_bytes(bytes(data))
    with pytest.raises(DraftTrainError, match="shard-00001.safetensors fails its checksum"):
        FeatureStore(out, verify="full")
    lazy = FeatureStore(out)  # lazy: shard 0 reads fine, shard 1 is refused on first use
    lazy.feature(0, "taps")
    with pytest.raises(DraftTrainError, match="checksum"):
        lazy.examples()
    with pytest.raises(DraftTrainError, match="checksum"):  # a resumed capture refuses it too
        _capture(setup, out)
    # a shard whose tensors have the wrong shape (record rewritten to match the file) is refused by shape
    from safetensors.torch import load_file

    t = load_file(out / S.shard_name(2))
    t["taps"] = t["taps"][:, :-1].contiguous()
    rec = S.write_shard(out, 2, t, {"format": "pt"})
    idx = json.loads((out / S.INDEX).read_text())
    idx["shards"][2] = rec
    (out / S.INDEX).write_text(json.dumps(idx))
    with pytest.raises(DraftTrainError, match="shard-00002.safetensors has the wrong tensors"):
        FeatureStore(out, verify="size")


def test_capture_refuses_other_settings_and_foreign_directories(setup, tmp_path):
    out = tmp_path / "p"
    _capture(setup, out)
    with pytest.raises(DraftTrainError, match="different dtype"):
        _capture(setup, out, dtype="bfloat16")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(DraftTrainError, match="not empty"):
        _capture(setup, other)
    with pytest.raises(DraftTrainError, match="no offline capture"):
        _capture(setup, tmp_path / "m2", method="medusa2")


def test_medusa_capture_stores_the_last_hidden_state_only(setup, tmp_path):
    model, tok, examples, _ = setup
    _capture(setup, tmp_path / "m", method="medusa", taps=None, dtype="bfloat16")
    fs = FeatureStore(tmp_path / "m")
    H = model.config.hidden_size
    assert fs.features == {"last_hidden": H} and fs.meta["bytes_per_token"] == 2 * H + 5
    with pytest.raises(DraftTrainError, match="no feature 'taps'"):
        fs.batch([0], 8, ["taps"])


# ---------------------------------------------------------------------------- multi-process, end to end
@pytest.mark.slow
def test_two_process_capture_writes_every_shard_once(tmp_path_factory, tiny_builtin_target):
    feats = capture_run(tmp_path_factory)
    fs = FeatureStore(feats, verify="full")
    ranks = [r["rank"] for r in fs.records]
    assert len(fs.records) >= 4 and ranks == [k % 2 for k in range(len(fs.records))]  # shard k by rank k % 2
    assert sorted(p.name for p in feats.glob("shard-*.safetensors")) == [r["file"] for r in fs.records]
    assert fs.meta["num_examples"] == len(fs) and fs.meta["dtype"] == "float32"


@pytest.mark.slow
def test_offline_training_matches_online(tmp_path_factory, tiny_builtin_target):
    """Same data and seed: training from the stored features (here under ZeRO-2 with 2 processes) gives the
    losses of online training in 1 process."""
    from .test_distributed import assert_same_curve

    ref = reference_run(tmp_path_factory)
    off = zero2_offline_run(tmp_path_factory)
    state = json.loads((off / "checkpoints" / "step_00000004" / "state.json").read_text())
    assert state["config"]["capture"]["mode"] == "offline" and state["world_size"] == 2
    assert_same_curve(history(ref), history(off))
    # ... without loading the target's decoder layers (EAGLE-3: embeddings, final norm and lm_head only)
    log = (off / "stdout.log").read_text()
    assert "capture.mode=offline: loaded" in log and "), decoder layers 0..7 were not loaded" in log, log[-3000:]


# ------------------------------------------------------------------ Medusa-1 and distillation from features
def _online_vs_offline_loss(setup, fs, method, idx):
    from drafttrain.data.chat import collate

    model, tok, examples, _ = setup
    torch.manual_seed(0)
    drafter = method.build_drafter(model, examples, "t")
    mb = collate([examples[i] for i in idx], tok.pad_token_id)
    on = method.capture(model, mb)
    off = method.capture_from_features(model, mb, fs.batch(idx, mb["input_ids"].shape[1], method.offline_features))
    counts = method.count_valid(drafter, mb, on)
    assert torch.equal(counts, method.count_valid(drafter, mb, off))
    loss_on, _ = method.loss(drafter, drafter, mb, on, counts, 1.0)
    loss_off, _ = method.loss(drafter, drafter, mb, off, counts, 1.0)
    return on, off, mb, float(loss_on.detach()), float(loss_off.detach())


def test_medusa_and_distill_train_from_stored_features(setup, tmp_path):
    """Medusa-1 and distillation read the stored last hidden state (heads' input; teacher logits through the
    target's lm_head): same capture and same loss as online."""
    from drafttrain.config import DistillConfig, MedusaConfig
    from drafttrain.training.draft_model import DraftModelMethod as DistillMethod
    from drafttrain.training.medusa import MedusaMethod

    model, tok, examples, _ = setup
    _capture(setup, tmp_path / "m", method="medusa", taps=None)
    fs = FeatureStore(tmp_path / "m", verify="full")
    idx = [5, 1, 9]

    medusa = MedusaMethod(MedusaConfig(num_heads=2), tok, model)
    on, off, mb, l_on, l_off = _online_vs_offline_loss(setup, fs, medusa, idx)
    real = mb["attention_mask"].bool()
    assert torch.allclose(off.hidden[real], on.hidden[real], atol=1e-5)
    assert l_on > 0 and abs(l_on - l_off) <= 1e-5 * l_on

    distill = DistillMethod(DistillConfig(), tok, model)
    on, off, mb, l_on, l_off = _online_vs_offline_loss(setup, fs, distill, idx)
    assert torch.allclose(off.teacher_logits[real], on.teacher_logits[real], atol=1e-4)
    assert l_on > 0 and abs(l_on - l_off) <= 1e-4 * l_on


def test_offline_refuses_medusa2_and_on_policy_distillation(setup, tmp_path):
    from types import SimpleNamespace

    from drafttrain.config import DistillConfig, MedusaConfig
    from drafttrain.training.draft_model import DraftModelMethod as DistillMethod
    from drafttrain.training.offline import check_store as _check_offline
    from drafttrain.training.medusa import MedusaMethod

    model, tok, _, _ = setup
    _capture(setup, tmp_path / "m", method="medusa", taps=None)
    fs = FeatureStore(tmp_path / "m")
    job = SimpleNamespace(capture=SimpleNamespace(path=str(tmp_path / "m")), distill=DistillConfig(on_policy_ratio=0.5))
    _check_offline(fs, MedusaMethod(MedusaConfig(), tok, model), SimpleNamespace(**job.__dict__, method="medusa"))
    with pytest.raises(DraftTrainError, match="Medusa-2 trains adapters inside the target.*capture.mode=online"):
        _check_offline(fs, MedusaMethod(MedusaConfig(), tok, model, joint=True),
                       SimpleNamespace(**job.__dict__, method="medusa2"))
    with pytest.raises(DraftTrainError, match="on_policy_ratio=0.5.*capture.mode=online"):
        _check_offline(fs, DistillMethod(DistillConfig(on_policy_ratio=0.5), tok, model),
                       SimpleNamespace(**job.__dict__, method="draft_model"))
    eagle = setup[3]
    with pytest.raises(DraftTrainError, match="lacks taps"):
        _check_offline(fs, eagle, SimpleNamespace(**job.__dict__, method="eagle3", eagle3=None))


# ------------------------------------------------------------------ the loop loads only the target's parts
@pytest.mark.slow
def test_offline_training_loads_only_the_target_parts_it_needs(setup, tiny_builtin_target, tmp_path, monkeypatch,
                                                               capsys):
    """distill (from_target_layers, 2 layers) trained offline in process: the target's other decoder layers are
    never materialised (they stay on meta) and the log says so; a run resumed from its checkpoint continues
    it exactly; the final evaluation alone loads the whole target (checkpoint evaluations: once, at the first)."""
    import re

    from accelerate.state import AcceleratorState, GradientState
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from drafttrain.cli import CONF_DIR  # importing the CLI registers the structured configs
    from drafttrain.targets import load as L
    from drafttrain.training import loop

    feats = tmp_path / "f"
    _capture(setup, feats, method="draft_model", taps=None, target_name=L.target_id(str(tiny_builtin_target)))
    parts, wholes = [], []
    real_parts, real_whole = L.load_target_parts, L.load_target
    monkeypatch.setattr(L, "load_target_parts", lambda *a, **k: parts.append(real_parts(*a, **k)) or parts[-1])
    monkeypatch.setattr(L, "load_target", lambda *a, **k: wholes.append(1) or real_whole(*a, **k))

    def train(run, *extra):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train", overrides=[
                "recipe=draft_model", f"target.name_or_path={tiny_builtin_target}", "logger=none", "capture.mode=offline",
                f"capture.path={feats}", "train.max_steps=2", "train.batch_size=4", "train.micro_batch_size=2",
                "train.warmup_steps=1", "train.save_every=1", "data.num_eval=2", "decode.num_prompts=2",
                "decode.max_new_tokens=8", "decode.warmup=0", "decode.sweep=[]", "decode.plot=false", *extra])
        run.mkdir()  # what Hydra does for a real run
        return loop.run_train(OmegaConf.to_object(cfg), run)

    try:
        train(tmp_path / "a", "train.eval=false")
        model = parts[0][0]
        n = model.config.num_hidden_layers
        assert all(not p.is_meta for p in model.model.layers[:2].parameters())
        assert all(p.is_meta for p in model.model.layers[2:].parameters())
        assert not model.get_output_embeddings().weight.is_meta and wholes == []
        out = capsys.readouterr().out
        assert re.search(rf"capture.mode=offline: loaded .*decoder layers 0\.\.1\), decoder layers 2\.\.{n - 1} were not "
                         "loaded", out), out

        report = train(tmp_path / "b", "train.eval=true",
                       f"train.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000001'}")
        assert len(parts) == 2 and wholes == [1]  # the whole target: once, for the evaluation
        assert "loading the whole target for the evaluation" in capsys.readouterr().out
        assert report["outputs_match_baseline"] is True and report["prompts"] == 2
        a = json.loads((tmp_path / "a" / "train_metrics.json").read_text())["history"]
        b = json.loads((tmp_path / "b" / "train_metrics.json").read_text())["history"]
        assert [h["step"] for h in b] == [2] and b[0]["loss"] == pytest.approx(a[1]["loss"], rel=1e-5)

        # train.eval_checkpoints: the whole target is loaded once, at the first checkpoint evaluation, and kept
        # (also for the final evaluation); training on from it gives the same losses
        train(tmp_path / "c", "train.eval=true", "train.eval_checkpoints=true")
        assert wholes == [1, 1]
        out = capsys.readouterr().out
        assert "loading the whole target on the main process (once)" in out, out
        assert json.loads((tmp_path / "c" / "checkpoints" / "step_00000001" / "report.json").read_text())[
            "outputs_match_baseline"] is True
        c = json.loads((tmp_path / "c" / "train_metrics.json").read_text())["history"]
        assert [h["loss"] for h in c] == pytest.approx([h["loss"] for h in a], rel=1e-5)
    finally:
        GlobalHydra.instance().clear()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
