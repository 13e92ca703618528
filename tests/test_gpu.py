"""The CUDA path: the same decoder, sampling and training code on a GPU.

Skipped without CUDA. The CPU path of each piece is tested elsewhere (test_decoding.py, test_tree.py,
test_train_e2e.py); these tests check that the code still holds when it runs on a GPU. That covers CUDA
generators, device tensors in the verifier, CUDA graphs via ``torch.compile(mode="reduce-overhead")`` and
bf16 autocast in training. ``scripts/gpu_check.sh`` runs them together with the GPU benchmark.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from drafttrain.decoding import (
    DraftModelProposer,
    Eagle3ChainProposer,
    Eagle3TreeProposer,
    MedusaChainProposer,
    MedusaTreeProposer,
    NoDraft,
    PromptLookupProposer,
    SpecDecoder,
    TargetRunner,
)

from .conftest import REPO, TINY_BUILTIN_OVERRIDES
from .test_decoding import (
    N_NEW,
    PROMPT_LEN,
    TAPS,
    TOY_NEW,
    TOY_PROMPT,
    TOY_V,
    V,
    L,
    ToyLM,
    _check_law,
    make_drafter,
    make_model,
    toy_eagle3,
    toy_law,
)
from .test_tree import TreeToyLM, medusa_heads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def cuda_llama():
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 verify and fp32 AR must round the same way
    model = make_model("llama", 0)
    drafter = make_drafter(model)  # built from the CPU copy, then moved
    heads = medusa_heads(model)
    model, drafter, heads = model.cuda(), drafter.cuda(), heads.cuda()
    draft_model = make_model("llama", 1).cuda()
    prompt = torch.randint(0, V, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ar = SpecDecoder(TargetRunner(model, max_len=256), NoDraft(), 0).generate(prompt, N_NEW).tokens
    return model, drafter, heads, draft_model, prompt, ar


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_greedy_equals_ar_for_every_method_on_cuda(cuda_llama, graphs):
    model, drafter, heads, draft_model, prompt, ar = cuda_llama
    kw = dict(static_shapes=graphs, compile=graphs)
    runners = {taps: TargetRunner(model, taps=taps, max_len=256, buckets=(1, 8, 16, 32), timing=False, **kw)
               for taps in (None, TAPS, (L,))}
    cases = {
        "draft_model": (None, DraftModelProposer(draft_model, max_len=256, buckets=(1, 4, 8), **kw), 4),
        "pld": (None, PromptLookupProposer(num_tokens=4), 4),
        "eagle3_chain": (TAPS, Eagle3ChainProposer(drafter, max_len=256, **kw), 4),
        "eagle3_tree": (TAPS, Eagle3TreeProposer(drafter, max_len=256, depth=4, top_k=3, total_tokens=12, **kw), 4),
        "medusa_chain": ((L,), MedusaChainProposer(heads), 4),
        "medusa_tree": ((L,), MedusaTreeProposer(heads), 4),
    }
    assert SpecDecoder(runners[None], NoDraft(), 0).generate(prompt, N_NEW).tokens == ar
    for name, (taps, prop, K) in cases.items():
        res = SpecDecoder(runners[taps], prop, K).generate(prompt, N_NEW)
        assert res.tokens == ar, name
        assert res.num_rounds <= N_NEW, name


def _cuda_toy_counts(name, T, k, p, n, seed):
    """Like test_decoding._toy_counts / test_tree._toy_tree_counts, with target and drafts on the GPU."""
    tree = name.endswith("_tree")
    target = (TreeToyLM if tree else ToyLM)(TOY_V, seed=1).cuda()
    if name == "draft_model":
        prop, taps, K = DraftModelProposer(ToyLM(TOY_V, seed=2).cuda()), (0, 1, 1), 2
    elif name == "eagle3_chain":
        prop, taps, K = Eagle3ChainProposer(toy_eagle3().cuda(), max_len=32), (0, 1, 1), 2
    else:
        prop, taps, K = Eagle3TreeProposer(toy_eagle3().cuda(), max_len=32, depth=3, top_k=2, total_tokens=5), \
            (0, 1, 1), 3
    dec = SpecDecoder(TargetRunner(target, taps=taps, max_len=32), prop, K, temperature=T, top_k=k, top_p=p,
                      seed=seed)
    counts = np.zeros((TOY_V,) * TOY_NEW)
    for _ in range(n):
        counts[tuple(dec.generate(TOY_PROMPT, TOY_NEW).tokens)] += 1
    return counts, toy_law(target.cpu(), T, k, p)


@pytest.mark.parametrize("name,T,k,p", [("draft_model", 1.0, 0, 1.0), ("draft_model", 0.7, 3, 0.9),
                                        ("eagle3_chain", 1.0, 4, 1.0), ("eagle3_tree", 0.8, 0, 0.9)])
def test_speculative_sampling_preserves_target_distribution_on_cuda(name, T, k, p):
    counts, law = _cuda_toy_counts(name, T, k, p, n=800, seed=100)
    assert min(_check_law(counts, law)) > 1e-3


def test_bf16_training_run_on_cuda(tmp_path):
    """A short EAGLE-3 run on the GPU with bf16 autocast: finite losses, a saved drafter, and an evaluation
    whose greedy outputs equal AR."""
    args = [*TINY_BUILTIN_OVERRIDES, "data.num_train=48", "data.regen_max_new_tokens=48", "data.num_eval=3",
            "data.max_length=160", "train.batch_size=4", "train.micro_batch_size=2", "train.max_steps=6",
            "train.warmup_steps=2", "train.save_every=3", "eagle3.ttt_steps=3", "logger=none",
            "decode.max_new_tokens=24", "decode.num_prompts=3", "decode.sweep_prompts=0", "decode.warmup=0",
            f"hydra.run.dir={tmp_path / 'run'}"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--mixed_precision", "bf16",
           str(REPO / "train.py"), "recipe=eagle3", *args]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-4000:]
    hist = json.loads((tmp_path / "run" / "train_metrics.json").read_text())["history"]
    assert hist and all(np.isfinite(h["loss"]) for h in hist)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["device"].startswith("cuda") and report["outputs_match_baseline"] is True
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_batched_greedy_equals_batch1_ar_on_cuda(graphs):
    """decode.batch_size > 1 on the GPU (drafttrain/decoding/batched.py), eager and under
    ``static_shapes=true compile=true`` (a CUDA graph per (row bucket, token bucket)), with continuous
    batching: prompts of mixed lengths, rows ending at different rounds, every row equal to batch-1 AR."""
    from drafttrain.decoding.batched import BatchSpecDecoder

    from .test_batched_decoding import LIMITS, METHODS, build

    torch.backends.cuda.matmul.allow_tf32 = False
    s = build("llama")
    model, draft, drafter, heads = (copy.deepcopy(m).cuda() for m in (s.model, s.draft, s.drafter, s.heads))
    kw = dict(static_shapes=graphs, compile=graphs, buckets=(1, 2, 4, 8))
    ar = [SpecDecoder(TargetRunner(model, max_len=96), NoDraft(), 0).generate(p, n, s.eos).tokens
          for p, n in zip(s.prompts, LIMITS)]
    for method, K in METHODS.items():
        taps = (4,) if method == "medusa" else (1, 2, 3)
        runner = TargetRunner(model, taps=taps, max_len=96, timing=False, **kw)
        prop = {"ar": NoDraft, "pld": lambda: PromptLookupProposer(max_ngram=3, num_tokens=4),
                "eagle3": lambda: Eagle3ChainProposer(drafter, max_len=256),
                "medusa": lambda: MedusaChainProposer(heads),
                "draft_model": lambda: DraftModelProposer(draft, max_len=256, **kw)}[method]()
        dec = BatchSpecDecoder(runner, prop, K)
        for width in (None, 2):
            assert dec.generate(s.prompts, LIMITS, eos_token_id=s.eos, batch_size=width).tokens == ar, (method, width)
        if graphs:
            assert dec.target._compiled is not None and dec.target.shapes
