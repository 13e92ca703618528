"""Medusa-1, Medusa-2 and distilled drafts trained by their recipes (train.py in a subprocess, tiny runs) and
scored by the decoder; plus the method adapters' own pieces in process (tiny random models)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers as tf

from .conftest import REPO, TINY_BUILTIN_OVERRIDES

# data=jsonl on a small file of stdlib chats: no regeneration, so the runs stay fast
COMMON = [
    *TINY_BUILTIN_OVERRIDES, "logger=none", "data=jsonl", "data.num_eval=2", "data.max_length=128",
    "train.max_steps=4", "train.batch_size=4", "train.micro_batch_size=2", "train.lr=3e-3", "train.warmup_steps=1",
    "decode.max_new_tokens=16", "decode.num_prompts=2", "decode.num_draft_tokens=3", "decode.warmup=0",
    "decode.sweep=[]",
]
# one thread per process: on a few shared cores, torch's default thread pool makes these runs ~10x slower
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
REPORT_KEYS = ["method", "target", "drafter", "prompts", "alpha", "acceptance_per_position", "tau", "tokens_per_s",
               "baseline_tokens_per_s", "speedup", "outputs_match_baseline", "train_estimated_tau",
               "target_modified"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


def _run(args, cwd, timeout=600):
    cmd = [sys.executable] + args
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert r.returncode == 0, f"{' '.join(cmd)}\nSTDOUT:\n{r.stdout[-3000:]}\nSTDERR:\n{r.stderr[-5000:]}"
    return r


@pytest.fixture(scope="module")
def chats(tmp_path_factory, tiny_builtin_target):
    from drafttrain.data.builtin import builtin_conversations

    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    rows = [{"messages": c.messages} for c in builtin_conversations("draft", 14, seed=1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(tmp_path_factory, chats, recipe, *extra):
    run = tmp_path_factory.mktemp("runs") / recipe
    _run([str(REPO / "train.py"), f"recipe={recipe}", *COMMON, f"data.path={chats}", *extra,
          f"hydra.run.dir={run}"], cwd=REPO)
    return run


def _report(run):
    report = json.loads((run / "report.json").read_text())
    for k in REPORT_KEYS:
        assert k in report, k
    return report


def _history(run):
    return json.loads((run / "train_metrics.json").read_text())["history"]


@pytest.fixture(scope="module")
def medusa_run(tmp_path_factory, chats):
    return _train(tmp_path_factory, chats, "medusa", "medusa.num_heads=3", "medusa.tree_num_nodes=6",
                  "train.save_every=2", "train.eval_checkpoints=true")


@pytest.fixture(scope="module")
def medusa2_run(tmp_path_factory, chats):
    return _train(tmp_path_factory, chats, "medusa2", "medusa.num_heads=3", "medusa.lora.r=4",
                  "medusa.lora.target_modules=[q_proj,v_proj]", "train.save_every=2")


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory, chats):
    return _train(tmp_path_factory, chats, "draft_model", "distill.loss=jsd", "distill.on_policy_ratio=0.5",
                  "distill.on_policy_max_new_tokens=8", "train.save_every=2", "train.eval_checkpoints=true")


@pytest.mark.slow
@pytest.mark.parametrize("run", ["medusa_run", "distill_run"])
def test_checkpoints_are_evaluated(run, request):
    """train.eval_checkpoints: the drafter as of each checkpoint is decoded (Medusa heads; the draft LM)."""
    report = json.loads((request.getfixturevalue(run) / "checkpoints" / "step_00000002" / "report.json").read_text())
    assert report["outputs_match_baseline"] is True and report["tau"] >= 1.0
    assert report["drafter"].endswith("step_00000002")


@pytest.mark.slow
def test_medusa1_recipe_end_to_end(medusa_run):
    r = _report(medusa_run)
    assert r["method"] == "medusa" and r["prompts"] == 2 and r["target_modified"] is False
    assert r["outputs_match_baseline"] is True
    assert r["tau"] >= 1.0 and len(r["acceptance_per_position"]) == 3
    hist = _history(medusa_run)
    assert [h["step"] for h in hist] == [1, 2, 3, 4]
    assert all(f"acc_{k}" in h and f"racc_{k}_0" in h for h in hist for k in range(3))
    assert hist[-1]["loss"] < hist[0]["loss"]
    from drafttrain.drafters.medusa import MedusaHeads

    heads = MedusaHeads.from_pretrained(medusa_run / "final")
    assert heads.num_heads == 3
    cfg = json.loads((medusa_run / "final" / "config.json").read_text())
    assert cfg["drafter_type"] == "medusa" and len(cfg["medusa_choices"]) == 6
    assert len(cfg["head_topk_accuracy"]) == 3


@pytest.mark.slow
def test_medusa2_recipe_end_to_end(medusa2_run, tiny_builtin_target):
    r = _report(medusa2_run)
    assert r["method"] == "medusa" and r["target_modified"] is True  # Medusa-2 changes the target
    assert r["outputs_match_baseline"] is True  # equal to the *adapted* target's AR
    hist = _history(medusa2_run)
    assert hist[0]["lm_loss"] == pytest.approx(0.0, abs=1e-6)  # self-distillation KL is 0 at step 0
    assert hist[-1]["lm_loss"] > 0.0  # the adapters moved
    final = medusa2_run / "final"
    assert json.loads((final / "config.json").read_text())["drafter_type"] == "medusa2"
    assert (final / "adapter" / "adapter_config.json").exists() and (final / "heads" / "config.json").exists()
    # the checkpoint holds only trained tensors (heads + LoRA), not the frozen target
    from safetensors.torch import load_file

    ck = load_file(medusa2_run / "checkpoints" / "step_00000002" / "drafter.safetensors")
    assert ck and all(k.startswith("heads.") or "lora_" in k for k in ck)
    assert any("lora_B" in k for k in ck)
    # reload: the adapter merged into a fresh target changes its weights (and only the adapted ones)
    from drafttrain.artifacts import load_medusa

    base = tf.AutoModelForCausalLM.from_pretrained(tiny_builtin_target).eval()
    ref = {k: v.clone() for k, v in base.state_dict().items()}
    merged, heads, info = load_medusa(final, base)
    assert info["target_modified"] is True and heads.num_heads == 3
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, ref[k])]
    assert changed and all(("q_proj" in k or "v_proj" in k) for k in changed)


@pytest.mark.slow
def test_medusa2_two_processes_match_one(tmp_path_factory, chats):
    """Medusa-2 (LoRA inside the target, heads) under DDP with 2 processes: the loss curve of 1 process with the
    same global batch. LoRA dropout is off here: its masks are drawn per process, so with dropout the curves
    differ by design (the math is the same)."""
    extra = ["medusa.num_heads=3", "medusa.lora.r=4", "medusa.lora.dropout=0", "train.eval=false",
             "train.log_every=1", "train.save_every=100"]
    one = _train(tmp_path_factory, chats, "medusa2", *extra)
    two = tmp_path_factory.mktemp("runs") / "medusa2-ddp"
    _run(["-m", "accelerate.commands.launch", "--config_file", str(REPO / "conf/accelerate/ddp_cpu.yaml"),
          str(REPO / "train.py"), "recipe=medusa2", *COMMON, f"data.path={chats}", *extra, f"hydra.run.dir={two}"],
         cwd=REPO)
    a, b = _history(one), _history(two)
    assert [h["step"] for h in a] == [h["step"] for h in b] and len(a) == 4
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-4, abs=1e-7)
    assert a[-1]["lm_loss"] > 0  # the adapters moved, in both runs alike


@pytest.mark.slow
def test_eval_command_reloads_medusa2_with_adapted_target(medusa2_run, tmp_path):
    out = tmp_path / "ev"
    _run(["-m", "drafttrain.cli", "eval", f"drafter={medusa2_run / 'final'}", *TINY_BUILTIN_OVERRIDES,
          "data=builtin", "data.num_eval=2", "decode.num_prompts=2", "decode.max_new_tokens=12",
          "decode.num_draft_tokens=3", "decode.warmup=0", "decode.sweep=[]", f"hydra.run.dir={out}"], cwd=tmp_path)
    r = json.loads((out / "report.json").read_text())
    assert r["method"] == "medusa" and r["target_modified"] is True and r["outputs_match_baseline"] is True


@pytest.mark.slow
def test_distill_recipe_end_to_end(distill_run):
    r = _report(distill_run)
    assert r["method"] == "draft_model" and r["target_modified"] is False
    assert r["outputs_match_baseline"] is True
    assert r["on_policy_rows"] == 4 * 2  # 4 steps x 2 micro-batches x round(0.5 * 2) rows
    hist = _history(distill_run)
    assert all("jsd" in h and "accept" in h for h in hist)
    final = distill_run / "final"
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["drafter_type"] == "draft_model" and cfg["num_hidden_layers"] == 2
    m = tf.AutoModelForCausalLM.from_pretrained(final)
    assert m.config.vocab_size == 2049  # the built-in target's 2048 BPE tokens + its reserved <|mask|>
    assert (final / "tokenizer.json").exists()


# ---------------------------------------------------------------------------------------- in process
V = 96
SMALL_LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


class _Tok:
    eos_token_id = 2
    pad_token_id = 0

    def save_pretrained(self, path):
        pass


def _target(seed=0):
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL_LLAMA)).eval().requires_grad_(False)


def _batch(seed=0, B=2, T=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, -3:] = 0
    lm = torch.zeros(B, T, dtype=torch.long)
    lm[:, 4:] = 1
    lm = lm * am
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def _cfg(section, **over):
    """``section``'s dataclass with ``over`` set; a name it does not have is an error (no silent attribute), and a
    dict sets the fields of a sub-config (``experimental=dict(align_top_k=1)``)."""
    import dataclasses

    import drafttrain.config as C

    cfg = getattr(C, section)()
    names = {f.name for f in dataclasses.fields(cfg)}
    for k, v in over.items():
        if k not in names:
            raise AttributeError(f"{section} has no field {k!r}")
        if isinstance(v, dict) and dataclasses.is_dataclass(getattr(cfg, k)):
            v = dataclasses.replace(getattr(cfg, k), **v)
        setattr(cfg, k, v)
    return cfg


def test_medusa2_step0_kl_is_zero_and_heads_start_as_lm_head():
    from drafttrain.training.medusa import MedusaMethod

    t = _target()
    cfg = _cfg("MedusaConfig", num_heads=2, heads_coefficient=0.2)
    m = MedusaMethod(cfg, _Tok(), t, joint=True)
    d = m.build_drafter(t, [], "tiny")
    b = _batch()
    cap = m.capture(t, b)
    counts = m.count_valid(d, b, cap)
    loss, st = m.loss(d, d, b, cap, counts, 1.0)
    assert float(st["lm_sum"]) == pytest.approx(0.0, abs=1e-6)
    # the joint forward: heads read the adapted target's hidden; a fresh head 0 = the target's LM head
    head_logits, lm_logits = d(b["input_ids"], b["attention_mask"])
    torch.testing.assert_close(head_logits[0], lm_logits, rtol=1e-5, atol=1e-5)
    loss.backward()
    lora_b = [p for n, p in d.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)  # heads train the target
    groups = m.param_groups(d, 1e-3)
    assert [g["lr"] for g in groups] == [1e-3, pytest.approx(1e-3 * cfg.head_lr_multiplier)]
    assert sum(len(g["params"]) for g in groups) == len(d.trainable_parameters())


def test_medusa2_checkpoint_round_trip(tmp_path):
    from drafttrain.training import checkpoint
    from drafttrain.training.medusa import MedusaMethod

    def build(seed):
        t = _target(0)
        m = MedusaMethod(_cfg("MedusaConfig", num_heads=2), _Tok(), t, joint=True)
        d = m.build_drafter(t, [], "tiny")
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in d.trainable_parameters():
                p.add_(torch.randn_like(p) * 0.01)
        return d

    a, b = build(1), build(2)
    opt = torch.optim.AdamW(a.trainable_parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoint.save_checkpoint(tmp_path / "ck", a, opt, sched, 3, {"method": "medusa2", "target": "tiny"})
    opt_b = torch.optim.AdamW(b.trainable_parameters())
    assert checkpoint.load_checkpoint(tmp_path / "ck", b, opt_b, torch.optim.lr_scheduler.LambdaLR(
        opt_b, lambda s: 1.0)) == 3
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(k.startswith("heads.") or "lora_" in k for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_default_tree_from_measured_accuracy():
    from drafttrain.decoding.tree import expected_accepted_length, medusa_choices_from_accuracy
    from drafttrain.training.medusa import MedusaMethod

    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    tree = medusa_choices_from_accuracy(acc, 5)
    # path products: [0] .6, [0,0] .24, [1] .2, [0,1] .12, [2] .1 | [1,0] .08, [0,0,0] .072 left out
    assert tree == [[0], [1], [2], [0, 0], [0, 1]]
    paths = {tuple(p) for p in tree}
    assert all(tuple(p[:-1]) in paths for p in tree if len(p) > 1)  # closed under prefixes
    assert expected_accepted_length(tree, acc) == pytest.approx(0.6 + 0.2 + 0.1 + 0.24 + 0.12)
    # finalize() takes the accuracies the training measured
    m = MedusaMethod(_cfg("MedusaConfig", num_heads=3, tree_top_k=3, tree_num_nodes=5), _Tok(), _target())
    summary = {f"racc_{k}_{i}": acc[k][i] for k in range(3) for i in range(3)}
    from drafttrain.training.medusa import MedusaTrainable

    holder = MedusaTrainable(torch.nn.Linear(1, 1))
    m.finalize(holder, summary)
    assert holder.medusa_choices == tree


def test_rank_accuracy_counts_match_top1():
    from drafttrain.training.medusa import MedusaMethod

    t = _target()
    m = MedusaMethod(_cfg("MedusaConfig", num_heads=2, tree_top_k=4), _Tok(), t)
    d = m.build_drafter(t, [], "tiny")
    b = _batch(3)
    cap = m.capture(t, b)
    _, st = m.loss(d, d, b, cap, m.count_valid(d, b, cap), 1.0)
    s = m.summarize(st)
    for k in range(2):
        assert s[f"racc_{k}_0"] == pytest.approx(s[f"acc_{k}"])
        assert sum(s[f"racc_{k}_{i}"] for i in range(4)) <= s[f"top5_{k}"] + 1e-6


def test_distill_loss_switch_and_mixes():
    from drafttrain.io import DraftTrainError
    from drafttrain.losses import ce_loss, kd_loss, next_token_mask
    from drafttrain.training.draft_model import DraftModelMethod as DistillMethod, parse_loss

    assert parse_loss("ce") == "ce" and parse_loss("TVD") == "tvd"
    assert parse_loss("fkl:0.5, tvd:2") == {"fkl": 0.5, "tvd": 2.0}
    with pytest.raises(DraftTrainError, match="distill.loss=kl"):
        parse_loss("kl")
    t = _target()
    b = _batch(1)
    for spec in ("ce", "tvd", "fkl:0.5,rkl:0.5"):
        m = DistillMethod(_cfg("DistillConfig", loss=spec, num_layers=2, init="from_config"), _Tok(), t)
        d = m.build_drafter(t, [], "tiny")
        cap = m.capture(t, b)
        n = m.count_valid(d, b, cap)
        loss, st = m.loss(d, d, b, cap, n, 1.0)
        logits = d(b["input_ids"], b["attention_mask"])
        if spec == "ce":
            ref, _ = ce_loss(logits, b["input_ids"], b["attention_mask"], b["loss_mask"])
        else:
            ref, _ = kd_loss(logits, cap.teacher_logits, next_token_mask(b["attention_mask"], b["loss_mask"]),
                             kind=parse_loss(spec))
        torch.testing.assert_close(loss, ref)


def test_on_policy_rows_are_the_drafts_own_samples():
    """Rows picked for on-policy data keep their prompt and continue with what the draft samples: a draft
    forced to emit token 7 yields continuations of 7s (the data never has them there)."""
    from drafttrain.training.draft_model import DraftModelMethod as DistillMethod, prompt_len

    t = _target()
    m = DistillMethod(_cfg("DistillConfig", num_layers=1, on_policy_ratio=0.5, on_policy_max_new_tokens=5,
                           on_policy_temperature=1.0), _Tok(), t)
    d = m.build_drafter(t, [], "tiny")
    bump = torch.zeros(V)
    bump[7] = 1e4
    d.lm.lm_head.register_forward_hook(lambda mod, i, out: out + bump)
    rows = [{"input_ids": [1, 5, 6, 8, 9, 10], "loss_mask": [0, 0, 0, 1, 1, 1]} for _ in range(4)]
    out = m.transform_examples(d, [rows, rows], step=0, rank=0)
    for mb in out:
        new = [r for r in mb if r not in rows]
        assert len(new) == 2  # round(0.5 * 4)
        for r in new:
            assert r["input_ids"] == [1, 5, 6] + [7] * 5 and r["loss_mask"] == [0, 0, 0] + [1] * 5
            assert prompt_len(r) == 3
    again = m.transform_examples(d, [rows, rows], step=0, rank=0)
    assert again == out  # a function of (seed, step, rank, micro-batch): resumable


@pytest.mark.parametrize("init,hidden", [("from_target_layers", None), ("from_config", 16)])
def test_distill_checkpoint_and_save_round_trip(tmp_path, init, hidden):
    """Checkpoints leave out the (frozen or LM-head-tied) input embedding and still restore the draft exactly;
    the saved HF directory reloads to the same logits."""
    from drafttrain.training import checkpoint
    from drafttrain.training.draft_model import DraftModelMethod as DistillMethod

    t = _target()
    cfg = _cfg("DistillConfig", init=init, num_layers=2, hidden_size=hidden, intermediate_size=32 if hidden else None)

    def build(seed):
        m = DistillMethod(cfg, _Tok(), t)
        d = m.build_drafter(t, [], "tiny")
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in d.trainable_parameters():
                p.add_(torch.randn_like(p) * 0.05)
        return d

    a, b = build(1), build(2)
    emb = a.lm.get_input_embeddings().weight
    if hidden:  # tied to the trained LM head
        assert emb is a.lm.get_output_embeddings().weight and emb.requires_grad
    else:  # frozen copy of the target's
        assert not emb.requires_grad and torch.equal(emb, t.get_input_embeddings().weight)
    opt = torch.optim.AdamW(a.trainable_parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoint.save_checkpoint(tmp_path / "ck", a, opt, sched, 1, {"method": "draft_model", "target": "tiny"})
    opt_b = torch.optim.AdamW(b.trainable_parameters())
    checkpoint.load_checkpoint(tmp_path / "ck", b, opt_b, torch.optim.lr_scheduler.LambdaLR(opt_b, lambda s: 1.0))
    ids = torch.randint(3, V, (1, 10))
    a.eval(), b.eval()
    with torch.no_grad():
        ref = a(ids)
        torch.testing.assert_close(b(ids), ref, rtol=0, atol=0)
    a.save_pretrained(tmp_path / "final")
    re = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    assert re.config.drafter_type == "draft_model"
    with torch.no_grad():
        torch.testing.assert_close(re(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_every_stop_token_of_the_target_stays_in_the_eagle3_draft_vocabulary():
    """Llama-3 / Qwen3 list several end tokens in generation_config; the draft vocabulary keeps every one,
    even one the training answers never contain (else the drafter could never propose it)."""
    from drafttrain.data.chat import stop_token_ids
    from drafttrain.training.eagle3 import Eagle3Method

    t = _target()
    t.generation_config.eos_token_id = [2, V - 1]  # V - 1: never in the data below
    assert stop_token_ids(t, _Tok()) == [2, V - 1]
    m = Eagle3Method(_cfg("Eagle3Config", ttt_steps=2, draft_vocab_size=8), _Tok(), t)
    examples = [{"input_ids": list(range(3, 20)), "loss_mask": [1] * 17, "attention_mask": [1] * 17}]
    d = m.build_drafter(t, examples, "tiny")
    assert bool(d.t2d[2]) and bool(d.t2d[V - 1])
