"""capture.backend=vllm without vLLM: the layer-id mapping, the conversion of the driver's states into the
store's features, the job-file checks, the next-token check, resume, the config key and the missing-venv error.
A fake driver writes job files in vllm_capture_driver.py's format from HF forwards (HF ``hidden_states[i]`` for
vLLM id ``i < L``, the final norm's *input* for id ``L``, as vLLM gives them); the real one runs in the engine
tier (tests/test_engine_capture.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drafttrain.capture import store as S
from drafttrain.capture.capture import run_capture
from drafttrain.capture.store import FeatureStore
from drafttrain.capture.vllm import VllmSource, check_next_tokens, engine_layer_ids, features_from_states
from drafttrain.io import DraftTrainError

from .test_capture import interrupt_after_shards


@pytest.fixture(scope="module")
def setup(tiny_builtin_target):
    torch.set_num_threads(1)
    from drafttrain.config import TargetConfig
    from drafttrain.data.builtin import builtin_conversations
    from drafttrain.data.chat import tokenize_conversations
    from drafttrain.targets.load import load_target

    model, tok, path = load_target(TargetConfig(name_or_path=str(tiny_builtin_target)))
    examples, _ = tokenize_conversations(tok, builtin_conversations("draft", 10, 0), 96, "truncate")
    return model, tok, examples, path


@torch.no_grad()
def engine_states(model, ids: list[int], layer_ids: list[int]) -> tuple[torch.Tensor, int, int]:
    """What vLLM's extract_hidden_states gives for one prompt: ``[T, len(layer_ids), H]`` and the greedy next
    token (and, for a broken driver, the least likely one)."""
    L = model.config.num_hidden_layers
    seen = []
    h = model.model.norm.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    try:
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        h.remove()
    per = [seen[0][0] if i == L else out.hidden_states[i][0] for i in layer_ids]
    return torch.stack(per, dim=1), int(out.logits[0, -1].argmax()), int(out.logits[0, -1].argmin())


class FakeDriver:
    """vllm_capture_driver.py's contract, computed with HF: skips jobs whose file exists; records what it ran."""

    def __init__(self, model, corrupt=None):
        self.model, self.ran, self.specs, self.corrupt = model, [], [], corrupt

    def __call__(self, spec: dict) -> dict:
        from safetensors.torch import save_file

        self.specs.append(spec)
        assert spec["layer_ids"] == sorted(set(spec["layer_ids"]))
        for job in spec["jobs"]:
            if Path(job["out"]).exists():
                continue
            self.ran.append(job["name"])
            got = [engine_states(self.model, p, spec["layer_ids"]) for p in job["prompts"]]
            lengths = torch.tensor([len(p) for p in job["prompts"]])
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            t = {"hidden_states": torch.cat([g[0] for g in got]).contiguous(),
                 "token_ids": torch.tensor([i for p in job["prompts"] for i in p], dtype=torch.int64),
                 "offsets": offsets, "next_token": torch.tensor([g[1] for g in got], dtype=torch.int64)}
            if self.corrupt:
                self.corrupt(t, torch.tensor([g[2] for g in got], dtype=torch.int64))
            save_file(t, job["out"])
        return {"jobs": []}


def _hf(setup, out, **kw):
    model, tok, examples, _ = setup
    args = dict(method="eagle3", taps=(2, 4, 5), dtype="float32", batch_size=4, shard_mb=0.15, target_name="t",
                pad_id=tok.pad_token_id, progress=False, say=lambda m: None)
    args.update(kw)
    return run_capture(model, examples, out, **args)


def _vllm(setup, out, driver, **kw):
    model, tok, examples, path = setup
    src = VllmSource(model, path, examples, out, batch_size=4, driver=driver)
    args = dict(method="eagle3", taps=(2, 4, 5), dtype="float32", batch_size=4, shard_mb=0.15, target_name="t",
                progress=False, say=lambda m: None, source=src)
    args.update(kw)
    return run_capture(None, examples, out, **args), src


def test_layer_ids_follow_the_hf_index_convention():
    eagle = {"features": {"taps": 3, "last_hidden": 1}}
    assert engine_layer_ids({**eagle, "taps": [2, 4, 5]}, 8) == [2, 4, 5, 8]
    assert engine_layer_ids({**eagle, "taps": [5, 2, 2]}, 8) == [2, 5, 8]  # vLLM sorts and dedups: we ask so
    assert engine_layer_ids({**eagle, "taps": [0, 4, 8]}, 8) == [0, 4, 8]  # tap L = last_hidden (post-norm)
    assert engine_layer_ids({"features": {"last_hidden": 1}, "taps": None}, 8) == [8]


@pytest.mark.parametrize("taps", [(2, 4, 5), (5, 0, 8), (3, 3, 1)])
def test_engine_states_become_the_hf_features(setup, taps):
    """Per token, the conversion of vLLM-convention states gives HF's taps (any order, repeats, tap 0 and L)
    and last hidden state."""
    from drafttrain.capture.capture import target_features

    model, _, examples, _ = setup
    L = model.config.num_hidden_layers
    H = model.config.hidden_size
    plan = {"features": {"taps": 3 * H, "last_hidden": H}, "taps": list(taps)}
    ids = engine_layer_ids(plan, L)
    ex = examples[3]["input_ids"]
    states = engine_states(model, ex, ids)[0]
    got = features_from_states(states, ids, plan, L, model.model.norm)
    ref = target_features(model, torch.tensor([ex]), torch.ones(1, len(ex), dtype=torch.long), list(taps))
    assert torch.allclose(got["taps"], ref["taps"][0], atol=1e-5)
    assert torch.allclose(got["last_hidden"], ref["last_hidden"][0], atol=1e-5)
    off = target_features(model, torch.tensor([ex]), torch.ones(1, len(ex), dtype=torch.long),
                          [t + 1 if t < L else t - 1 for t in taps])
    assert not torch.allclose(got["taps"], off["taps"][0], atol=1e-3)  # the comparison can fail: a tap one layer off
    with pytest.raises(DraftTrainError, match="tap 1 was not captured"):
        features_from_states(states[:, 1:], ids[1:], {**plan, "taps": [1, 2, 3]}, L, model.model.norm)


def test_vllm_source_writes_the_hf_store_and_resumes(setup, tmp_path, monkeypatch):
    _hf(setup, tmp_path / "hf")
    driver = FakeDriver(setup[0])
    calls = interrupt_after_shards(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        _vllm(setup, tmp_path / "v", driver)
    monkeypatch.undo()
    hf = FeatureStore(tmp_path / "hf", verify="full")
    n = len(hf.records)
    assert n >= 4 and sorted(driver.ran, key=int) == [str(k) for k in range(n)]  # one driver call, every shard
    work = sorted(p.name for p in (tmp_path / "v" / ".vllm-work").glob("*.safetensors"))
    assert work == [f"shard-{k:05d}.safetensors" for k in range(2, n)]  # converted shards' job files are gone
    driver.ran.clear()
    stats, src = _vllm(setup, tmp_path / "v", driver)
    assert stats["shards_skipped"] == 2 and stats["shards_written"] == n - 2
    assert driver.ran == []  # the job files of the interrupted run are converted, vLLM not rerun on them
    assert [j["name"] for j in driver.specs[-1]["jobs"]] == [str(k) for k in range(2, n)]
    assert not (tmp_path / "v" / ".vllm-work").exists() and src.max_gap < 1e-3
    vl = FeatureStore(tmp_path / "v", verify="full")
    assert vl.plan == hf.plan and vl.examples() == hf.examples()
    for name in hf.features:
        for i in range(len(hf)):
            assert torch.allclose(vl.feature(i, name), hf.feature(i, name), atol=1e-5), (name, i)
    stats, _ = _vllm(setup, tmp_path / "v", driver)  # finished: nothing left for the driver
    assert stats["shards_skipped"] == n and len(driver.specs) == 2


def test_medusa_from_vllm_stores_the_last_hidden_state(setup, tmp_path):
    driver = FakeDriver(setup[0])
    _vllm(setup, tmp_path / "m", driver, method="medusa", taps=None)
    _hf(setup, tmp_path / "h", method="medusa", taps=None)
    assert driver.specs[0]["layer_ids"] == [setup[0].config.num_hidden_layers]
    a, b = FeatureStore(tmp_path / "h"), FeatureStore(tmp_path / "m")
    assert a.plan == b.plan and b.features == {"last_hidden": setup[0].config.hidden_size}
    assert all(torch.allclose(a.feature(i, "last_hidden"), b.feature(i, "last_hidden"), atol=1e-5) for i in range(len(a)))


def test_job_files_of_other_tokens_or_rows_are_refused(setup, tmp_path):
    def swap_rows(t, _):  # another row's states and tokens: the #279 failure mode
        t["token_ids"] = t["token_ids"].flip(0)

    with pytest.raises(DraftTrainError, match="states of other tokens"):
        _vllm(setup, tmp_path / "a", FakeDriver(setup[0], corrupt=swap_rows))

    def wrong_next(t, least_likely):
        t["next_token"] = least_likely

    with pytest.raises(DraftTrainError, match="is not the argmax"):
        _vllm(setup, tmp_path / "b", FakeDriver(setup[0], corrupt=wrong_next))

    def short(t, _):
        t["hidden_states"] = t["hidden_states"][:, :-1].contiguous()

    with pytest.raises(DraftTrainError, match="holds .* expected"):
        _vllm(setup, tmp_path / "c", FakeDriver(setup[0], corrupt=short))
    assert not (tmp_path / "a" / S.INDEX).exists()


def test_next_token_check_allows_ties_within_tolerance():
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, 1e-7], [0.0, 1.0]]))
    rows = torch.tensor([[1.0, 0.0]])
    assert check_next_tokens(head, rows, torch.tensor([0]), [0]) < 1e-6  # near-tie: either token passes
    with pytest.raises(DraftTrainError, match="example 7"):
        check_next_tokens(head, rows, torch.tensor([2]), [7])


def test_backend_key_and_missing_engine_venv(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from drafttrain.capture.capture import run_capture_job
    from drafttrain.config import CaptureJob
    from drafttrain.validate import check_values

    from .test_config import _compose

    cfg = _compose("capture", ["capture.path=feats", "capture.backend=vllm"])
    assert cfg.capture.backend == "vllm"
    assert _compose("capture", ["capture.path=feats"]).capture.backend == "hf"
    with pytest.raises(Exception, match="backend"):
        check_values("capture", _compose("capture", ["capture.path=feats", "capture.backend=sglang"]))
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, CaptureJob)
    job.capture.path = str(tmp_path / "f")
    monkeypatch.setenv("DRAFTTRAIN_ENGINE_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(DraftTrainError, match=r"no engine venv at .*no-venv \(build it: scripts/make_engine_venv.sh"):
        run_capture_job(job)
    assert not (tmp_path / "f").exists()  # refused before anything was loaded or written
