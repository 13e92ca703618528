"""End to end: `train.py recipe=eagle3` on a tiny built-in target -> report.json, resume, eval, 2 processes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO, TINY_BUILTIN_OVERRIDES

pytestmark = pytest.mark.slow  # every test here runs train.py or the CLI in a subprocess

SMALL = [
    *TINY_BUILTIN_OVERRIDES,
    "data.num_train=48", "data.regen_max_new_tokens=48", "data.num_eval=3", "data.max_length=160",
    "train.batch_size=4", "train.micro_batch_size=2", "train.lr=3e-3", "train.warmup_steps=2",
    "eagle3.ttt_steps=3", "decode.max_new_tokens=24", "decode.num_prompts=3", "decode.num_draft_tokens=3",
    "logger=none",
    "train.ema_decay=0.5",  # the weight average: final/ holds it, checkpoints carry it, resume continues it
]
REPORT_KEYS = ["method", "target", "drafter", "prompts", "new_tokens", "num_draft_tokens", "temperature", "alpha",
               "acceptance_per_position", "tau", "tokens_per_s", "baseline_tokens_per_s", "speedup",
               "outputs_match_baseline", "train_estimated_tau"]


def _run(args, cwd, timeout=600, launcher=None):
    cmd = (launcher or [sys.executable]) + args
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert r.returncode == 0, f"{' '.join(cmd)}\nSTDOUT:\n{r.stdout[-3000:]}\nSTDERR:\n{r.stderr[-5000:]}"
    return r


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_builtin_target):
    run = tmp_path_factory.mktemp("run") / "eagle3"
    _run([str(REPO / "train.py"), "recipe=eagle3", *SMALL, "train.max_steps=6", "train.save_every=3",
          "train.keep_checkpoints=5", f"hydra.run.dir={run}"], cwd=REPO)
    return run


def test_train_writes_report_and_drafter(trained_run):
    report = json.loads((trained_run / "report.json").read_text())
    for k in REPORT_KEYS:
        assert k in report, k
    assert report["method"] == "eagle3" and report["prompts"] == 3
    assert report["outputs_match_baseline"] is True
    assert report["tau"] >= 1.0 and len(report["acceptance_per_position"]) == 3
    assert (trained_run / "acceptance.png").stat().st_size > 1000
    metrics = json.loads((trained_run / "train_metrics.json").read_text())
    hist = metrics["history"]
    assert [h["step"] for h in hist] == list(range(1, 7))
    # the cost of the run, for the results page's tokens per CPU-second and peak memory
    assert 0 < metrics["train_cpu_seconds"] and 100 < metrics["peak_memory_mb"]["rss"] < 64_000
    assert all("acc_0" in h and "accept_2" in h for h in hist)
    from drafttrain.drafters.eagle3 import Eagle3Drafter

    d = Eagle3Drafter.from_pretrained(trained_run / "final")
    assert d.config.tap_layers == [2, 4, 5]
    last = trained_run / "checkpoints" / "step_00000006"
    final, live, average = (load_file(p) for p in (trained_run / "final" / "model.safetensors",
                                                   last / "drafter.safetensors", last / "ema.safetensors"))
    assert average.keys() <= final.keys() and "fc.weight" in average and "embed_tokens.weight" not in average
    for k in average:  # final/ is the average of the run's weights, not the last step's weights
        assert torch.equal(final[k], average[k]), k
    assert not torch.equal(final["fc.weight"], live["fc.weight"])
    assert (trained_run / ".hydra" / "config.yaml").exists()


def test_resume_gives_identical_weights(trained_run, tmp_path):
    """Rebuild the state a crash after step 3 leaves (its checkpoint only) and resume to step 6."""
    run2 = tmp_path / "resumed"
    (run2 / "checkpoints").mkdir(parents=True)
    shutil.copytree(trained_run / "checkpoints" / "step_00000003", run2 / "checkpoints" / "step_00000003")
    _run([str(REPO / "train.py"), "recipe=eagle3", *SMALL, "train.max_steps=6", "train.save_every=3",
          "train.resume=auto", "train.eval=false", f"hydra.run.dir={run2}"], cwd=REPO)
    a = load_file(trained_run / "final" / "model.safetensors")
    b = load_file(run2 / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    h1 = json.loads((trained_run / "train_metrics.json").read_text())["history"]
    h2 = json.loads((run2 / "train_metrics.json").read_text())["history"]
    assert [h["loss"] for h in h1[3:]] == [h["loss"] for h in h2]


def test_eval_command_reloads_the_drafter(trained_run, tmp_path):
    out = tmp_path / "ev"
    _run(["-m", "drafttrain.cli", "eval", f"drafter={trained_run / 'final'}", *TINY_BUILTIN_OVERRIDES,
          "data.num_eval=3", "decode.num_prompts=3", "decode.max_new_tokens=24", "decode.num_draft_tokens=3",
          f"hydra.run.dir={out}"], cwd=tmp_path)
    r1 = json.loads((trained_run / "report.json").read_text())
    r2 = json.loads((out / "report.json").read_text())
    assert r2["outputs_match_baseline"] is True
    assert r2["tau"] == pytest.approx(r1["tau"]) and r2["alpha"] == pytest.approx(r1["alpha"])


@pytest.mark.slow
def test_two_processes_match_one(trained_run, tmp_path):
    run2 = tmp_path / "ddp"
    _run(["--config_file", str(REPO / "conf/accelerate/ddp_cpu.yaml"), str(REPO / "train.py"), "recipe=eagle3",
          *SMALL, "train.max_steps=6", "train.eval=false", f"hydra.run.dir={run2}"], cwd=REPO,
         launcher=[sys.executable, "-m", "accelerate.commands.launch"])
    h1 = json.loads((trained_run / "train_metrics.json").read_text())["history"]
    h2 = json.loads((run2 / "train_metrics.json").read_text())["history"]
    from drafttrain.training import checkpoint

    assert checkpoint.read_checkpoint_meta(checkpoint.list_checkpoints(run2)[-1])["world_size"] == 2
    assert len(h1) == len(h2) == 6
    for a, b in zip(h1, h2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-4)
        assert b["valid_tokens_0"] == a["valid_tokens_0"]


def _same_weights(a_path, b_path):
    a, b = load_file(a_path), load_file(b_path)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_checkpoint_evaluates_and_exports_as_the_drafter_it_holds(trained_run, tmp_path):
    ckpt = tmp_path / "step_00000006"  # a copy: the fixture's run stays as training left it
    shutil.copytree(trained_run / "checkpoints" / "step_00000006", ckpt)
    out = tmp_path / "ev"
    r = _run(["-m", "drafttrain.cli", "eval", f"drafter={ckpt}", *TINY_BUILTIN_OVERRIDES,
              "data.num_eval=3", "decode.max_new_tokens=24", "decode.num_draft_tokens=3",
              f"hydra.run.dir={out}"], cwd=tmp_path)
    assert "is a training checkpoint (step 6)" in r.stdout
    _same_weights(trained_run / "final" / "model.safetensors", ckpt / "drafter" / "model.safetensors")
    r1 = json.loads((trained_run / "report.json").read_text())
    r2 = json.loads((out / "report.json").read_text())
    assert r2["outputs_match_baseline"] is True and r2["tau"] == pytest.approx(r1["tau"])
    r = _run(["-m", "drafttrain.cli", "export", f"drafter={ckpt}", "format=vllm", f"out={tmp_path / 'vllm'}"],
             cwd=tmp_path)
    assert "training checkpoint" not in r.stdout  # built once, then reused
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["speculators_model_type"] == "eagle3"


@pytest.mark.parametrize("recipe,weights", [("medusa", "model.safetensors"), ("draft_model", "model.safetensors")])
def test_medusa_and_distill_checkpoints_are_their_final_drafters(recipe, weights, tmp_path, tiny_builtin_target):
    run = tmp_path / recipe
    r = _run([str(REPO / "train.py"), f"recipe={recipe}", *SMALL, "train.max_steps=2", "train.save_every=2",
              "train.eval=false", f"hydra.run.dir={run}"], cwd=REPO)
    # the final save of an HF model imports DeepSpeed (transformers -> accelerate); it must stay quiet on CPU
    assert "Setting accelerator" not in r.stdout + r.stderr
    from drafttrain.training.checkpoint import drafter_dir

    d = drafter_dir(run / "checkpoints" / "step_00000002")
    assert d.name == "drafter" and (d / "config.json").exists()
    _same_weights(run / "final" / weights, d / weights)


def test_eval_takes_a_prompt_file_without_answers_and_says_how_many_prompts(tmp_path, tiny_builtin_target):
    rows = [{"messages": [{"role": "user", "content": f"def f{i}(x):"}, {"role": "assistant", "content": ""}]}
            for i in range(4)] + [{"messages": [{"role": "user", "content": "import os"}]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["-m", "drafttrain.cli", "eval", "decode.method=pld", f"data={path}", *TINY_BUILTIN_OVERRIDES,
            "decode.max_new_tokens=8", "decode.sweep=[]"]
    r = _run([*args, f"hydra.run.dir={tmp_path / 'all'}"], cwd=tmp_path)
    assert f"eval: 5 prompts: every one of 5 rows of {path}" in r.stdout, r.stdout
    bar = r.stderr.replace("\r", "\n").splitlines()  # the progress bar's last state: all passes, running tau
    assert any(ln.startswith("eval pld vs AR: 100%") and "15/15" in ln and "tau " in ln for ln in bar), r.stderr
    assert json.loads((tmp_path / "all" / "report.json").read_text())["prompts"] == 5
    r = _run([*args, "data.num_eval=3", "decode.repeats=1", f"hydra.run.dir={tmp_path / 'last3'}"], cwd=tmp_path)
    assert f"eval: 3 prompts: the last 3 of 5 rows of {path}, held out from training" in r.stdout, r.stdout
    r = _run([*args, "decode.num_prompts=2", "decode.repeats=1", f"hydra.run.dir={tmp_path / 'two'}"], cwd=tmp_path)
    assert "eval: 2 prompts: every one of 5 rows" in r.stdout and "decode.num_prompts=2 of 5, 0 for all" in r.stdout
    assert json.loads((tmp_path / "two" / "report.json").read_text())["prompts"] == 2


def test_launch_with_the_shipped_config_is_quiet_and_prints_a_speed_estimate(tmp_path, tiny_builtin_target):
    """`accelerate launch --config_file conf/accelerate/single.yaml train.py …` (the README's main command): no
    launcher "defaults used" warnings, no DeepSpeed import in a run without DeepSpeed (on a CPU machine its
    import logs "Setting accelerator to CPU"), and one speed/ETA line after the warm-up step. 12 steps logged
    every 3: the averaged final metrics must cope with keys logged every train.log_every steps only."""
    import re

    run = tmp_path / "quiet"
    env_home = tmp_path / "hf_home"  # no ~/.cache/huggingface/accelerate/default_config.yaml of the developer's
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "conf/accelerate/single.yaml"), str(REPO / "train.py"), "recipe=eagle3", *SMALL,
           "train.max_steps=12", "train.log_every=3", "train.eval=false", f"hydra.run.dir={run}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HOME": str(env_home)})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert "had defaults used instead" not in out and "--num_processes" not in out, out[:2000]
    assert not re.search(r"Setting (ds_)?accelerator", out), out[-3000:]
    speed = [ln for ln in r.stdout.splitlines() if "[drafttrain] speed: " in ln]
    assert len(speed) == 1, r.stdout
    assert re.search(r"speed: [\d.]+ s/step \(\d+% in the target forward\), [\d,]+ real tokens/s, [\d,]+ real "
                     r"tokens/step \(4 conversations packed into rows of <= 160 tokens, 2 micro-batches of 2, "
                     r"target vocab \d+, 3 TTT steps\); ETA .+ for the 9 steps left of 12 \(measured over steps "
                     r"2-3, after a warm-up step\)", speed[0]), speed[0]
    metrics = json.loads((run / "train_metrics.json").read_text())
    logged = [h["step"] for h in metrics["history"] if "seconds_per_step" in h]
    assert logged == [3, 6, 9, 12]
    assert metrics["history"][-1]["eta_seconds"] == 0


def test_step_speed_leaves_out_the_warm_up_step():
    from drafttrain.training.speed import StepSpeed

    clock = iter([0.0, 0.5, 10.0,  # step 1 (warm-up): 10 s
                  10.0, 10.25, 11.0, 11.0, 11.25, 12.0,  # steps 2, 3: 1 s each, a quarter of it in the capture
                  20.0, 20.5, 23.0])  # step 4: 3 s (begun 8 s later: a checkpoint in between, not counted)
    speed = StepSpeed(world=2, start_step=0, max_steps=100, clock=lambda: next(clock))
    lines = []
    for _ in range(4):
        speed.begin()
        speed.captured()
        speed.end(real_tokens=50)
        lines.append(speed.estimate_line() if speed.estimate_ready() else None)
    assert lines[:2] == [None, None] and lines[3] is None  # once, after the 2 steps measured after the warm-up
    assert lines[2] == ("speed: 1.00 s/step (25% in the target forward), 100 real tokens/s, 100 real tokens/step; "
                        "ETA 1m37s for the 97 steps left of 100 (measured over steps 2-3, after a warm-up step)")
    assert speed.seconds_per_step == pytest.approx(5 / 3) and speed.tokens_per_s == pytest.approx(300 / 5)
