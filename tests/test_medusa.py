import json
import math

import pytest
import torch
import transformers as tf

from drafttrain.drafters.medusa import MedusaHeads, final_hidden
from drafttrain.io import DraftTrainError, load_tensors
from drafttrain.lora import add_lora, load_lora, save_lora
from drafttrain.losses import kd_fkl, medusa_head_weights, medusa_loss, medusa_valid_mask
from drafttrain.training.medusa import self_distillation_kl

V, H, L = 96, 32, 8
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHS = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}


def make_target(arch="llama", seed=0):
    torch.manual_seed(seed)
    C, M = ARCHS[arch]
    model = M(C(**COMMON)).eval()
    with torch.no_grad():  # a non-trivial final norm, so "normed" and "not normed" differ
        model.model.norm.weight.copy_(torch.rand(H) * 2 + 0.5)
    return model


def batch(seed=0, B=2, T=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, -2:] = 0  # right padding
    return ids, am


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hidden_states_last_is_post_norm(arch):
    """transformers 5: hidden_states[-1] is the final-norm output (what lm_head reads); final_hidden agrees."""
    t = make_target(arch)
    ids, am = batch()
    pre = []
    h = t.model.layers[-1].register_forward_hook(
        lambda m, a, out: pre.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = t(input_ids=ids, attention_mask=am, output_hidden_states=True)
    h.remove()
    last = out.hidden_states[-1]
    assert len(out.hidden_states) == L + 1
    torch.testing.assert_close(last, t.model.norm(pre[0]))
    assert not torch.allclose(last, pre[0], atol=1e-3)
    torch.testing.assert_close(t.lm_head(last), out.logits)
    with torch.no_grad():
        hidden, logits = final_hidden(t, ids, am)
    torch.testing.assert_close(hidden, last, rtol=0, atol=0)
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fresh_heads_equal_target_lm_head(arch):
    t = make_target(arch)
    heads = MedusaHeads.from_target(t, num_heads=3, num_layers=2)
    ids, am = batch()
    with torch.no_grad():
        hidden, logits = final_hidden(t, ids, am)
        out = heads(hidden)
    assert out.shape == (3, 2, 9, V)
    for k in range(3):
        torch.testing.assert_close(out[k], logits, rtol=1e-6, atol=1e-6)
    for p in heads.blocks.parameters():
        assert torch.count_nonzero(p) == 0
    # after training-like perturbation the heads differ from the LM head
    with torch.no_grad():
        heads.blocks[1].layers[0].weight.normal_()
        assert not torch.allclose(heads(hidden)[1], logits, atol=1e-3)
        torch.testing.assert_close(heads(hidden)[0], logits, rtol=1e-6, atol=1e-6)


def test_vllm_tensor_names_and_shapes():
    heads = MedusaHeads(H, V, num_heads=2, num_layers=2)
    shapes = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
    expected = {}
    for h in range(2):
        for layer in range(2):
            expected[f"blocks.{h}.layers.{layer}.weight"] = (H, H)
            expected[f"blocks.{h}.layers.{layer}.bias"] = (H,)
        expected[f"lm_heads.{h}.weight"] = (V, H)
    assert shapes == expected
    nobias = MedusaHeads(H, V, num_heads=1, num_layers=1, bias=False)
    assert set(nobias.state_dict()) == {"blocks.0.layers.0.weight", "lm_heads.0.weight"}
    assert nobias.config_dict()["medusa_fc_bias"] is False


def test_save_load_round_trip(tmp_path):
    t = make_target()
    heads = MedusaHeads.from_target(t, num_heads=3, num_layers=1, target_name_or_path="tiny-llama")
    torch.manual_seed(3)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path / "medusa"
    heads.save_pretrained(d)
    assert sorted(x.name for x in d.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["drafter_type"] == "medusa" and cfg["model_type"] == "medusa"
    assert cfg["architectures"] == ["MedusaModel"] and cfg["medusa_fc_bias"] is True
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_layers"]) == (H, V, 3, 1)
    assert cfg["target_name_or_path"] == "tiny-llama"
    assert set(load_tensors(d / "model.safetensors")) == set(heads.state_dict())

    back = MedusaHeads.from_pretrained(d)
    for k, v in heads.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        torch.testing.assert_close(back(x), heads(x), rtol=0, atol=0)

    with pytest.raises(DraftTrainError, match="refusing to overwrite"):
        heads.save_pretrained(d, overwrite=False)
    cfg["drafter_type"] = "eagle3"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftTrainError, match="drafter_type"):
        MedusaHeads.from_pretrained(d)
    cfg["drafter_type"] = "medusa"
    cfg["num_heads"] = 4
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftTrainError, match="missing"):
        MedusaHeads.from_pretrained(d)


# ----------------------------------------------------------------------------------------------- loss
def _ce(row, label):
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return lse - row[label]


def _rank(row, label):
    return sorted(range(len(row)), key=lambda i: -row[i]).index(label)


def test_medusa_valid_mask():
    am = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])
    lm = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])
    # head 0 (t -> t+2): row 0: t=0 (x2), t=1 (x3); t=2 -> x4 is padding. row 1: t=0 is padding; t=1 -> x3, t=2 -> x4
    assert medusa_valid_mask(am, lm, 0).tolist() == [[True, True, False, False, False],
                                                     [False, True, True, False, False]]
    # head 1 (t -> t+3): row 0: t=0 (x3); t=1 -> x4 padding. row 1: t=0 padding, t=1 -> x4
    assert medusa_valid_mask(am, lm, 1).tolist() == [[True, False, False, False, False],
                                                     [False, True, False, False, False]]
    assert not medusa_valid_mask(am, lm, 3).any()  # t+5 >= T everywhere


def test_medusa_loss_by_hand():
    Vs, T = 8, 5
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 2, T, Vs, generator=g).requires_grad_(True)  # [K, B, T, V]
    ids = torch.tensor([[1, 4, 6, 2, 7], [3, 3, 5, 0, 6]])
    am = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])
    lm = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])
    # valid (head, b, t) -> label x_{t+2+head}; see test_medusa_valid_mask
    valid = {0: [(0, 0, 6), (0, 1, 2), (1, 1, 0), (1, 2, 6)], 1: [(0, 0, 2), (1, 1, 6)]}
    w = [1.0, 0.8]
    loss, stats = medusa_loss(logits, ids, lm, am, w)
    L_ = logits.tolist()
    expected, top1, top5 = 0.0, [], []
    for k, items in valid.items():
        ces = [_ce(L_[k][b][t], y) for b, t, y in items]
        expected += w[k] * sum(ces) / len(ces)
        top1.append(sum(_rank(L_[k][b][t], y) == 0 for b, t, y in items))
        top5.append(sum(_rank(L_[k][b][t], y) < 5 for b, t, y in items))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["count"].tolist() == [4.0, 2.0]
    assert stats["top1_sum"].tolist() == top1
    assert stats["top5_sum"].tolist() == top5
    assert stats["ce"][1].item() == pytest.approx(sum(_ce(L_[1][b][t], y) for b, t, y in valid[1]) / 2, rel=1e-6)
    # the gradient touches exactly the valid positions
    loss.backward()
    touched = logits.grad.abs().sum(-1) > 0
    want = torch.zeros(2, 2, T, dtype=torch.bool)
    for k, items in valid.items():
        for b, t, _ in items:
            want[k, b, t] = True
    assert torch.equal(touched, want)
    # a list of per-head logits works the same
    loss2, _ = medusa_loss(list(logits.detach()), ids, lm, am, w)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)
    with pytest.raises(ValueError):
        medusa_loss(logits, ids, lm, am, [1.0])


def test_medusa_loss_no_valid_tokens_is_zero():
    logits = torch.randn(2, 1, 3, 8, requires_grad=True)
    ids = torch.zeros(1, 3, dtype=torch.long)
    loss, stats = medusa_loss(logits, ids, torch.zeros(1, 3), torch.ones(1, 3), [1.0, 1.0])
    assert loss.item() == 0.0 and stats["count"].tolist() == [0.0, 0.0]
    loss.backward()
    assert torch.count_nonzero(logits.grad) == 0


def test_medusa_head_weights():
    assert medusa_head_weights(4) == pytest.approx([1.0, 0.8, 0.64, 0.512])
    assert medusa_head_weights(3, decay=1.0) == [1.0, 1.0, 1.0]           # Medusa-1: unweighted sum
    assert medusa_head_weights(3, decay=0.8, coefficient=0.2) == pytest.approx([0.2, 0.16, 0.128])


def test_heads_train_on_target_hidden():
    """Heads fed with the target's final hidden reduce the Medusa loss (end-to-end smoke)."""
    t = make_target()
    heads = MedusaHeads.from_target(t, num_heads=2)
    ids, am = batch(T=12)
    with torch.no_grad():
        hidden, _ = final_hidden(t, ids, am)
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    w = medusa_head_weights(2)
    first = None
    for _ in range(20):
        loss, _ = medusa_loss(heads(hidden), ids, am, am, w)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


# ---------------------------------------------------------------------------------------------- Medusa-2
def _perturb_lora(model, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
                n += 1
    assert n > 0


def test_add_lora_trainable_parameters():
    pm = add_lora(make_target(), r=4, alpha=8, dropout=0.0)
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)  # all-linear excludes the output layer
    assert any("q_proj" in n for n in trainable) and any("down_proj" in n for n in trainable)


def test_lora_adapter_save_load_round_trip(tmp_path):
    ids, am = batch()
    pm = add_lora(make_target(seed=0), r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    _perturb_lora(pm)
    with torch.no_grad():
        adapted = pm(input_ids=ids, attention_mask=am).logits
        with pm.disable_adapter():
            base = pm(input_ids=ids, attention_mask=am).logits
    assert not torch.allclose(adapted, base, atol=1e-4)
    d = tmp_path / "lora"
    save_lora(pm, d)
    assert (d / "adapter_config.json").exists() and (d / "adapter_model.safetensors").exists()
    assert not list(d.glob("*.bin"))
    loaded = load_lora(make_target(seed=0), d)
    with torch.no_grad():
        again = loaded(input_ids=ids, attention_mask=am).logits
    torch.testing.assert_close(again, adapted, rtol=1e-6, atol=1e-6)
    with pytest.raises(DraftTrainError, match="adapter_config"):
        load_lora(make_target(seed=0), tmp_path)


def test_self_distillation_kl_zero_at_init_positive_after_update():
    ids, am = batch()
    lm = am.clone()
    lm[:, :3] = 0
    pm = add_lora(make_target(), r=4, alpha=8, dropout=0.05)
    pm.train()
    loss, stats = self_distillation_kl(pm, ids, am, lm)
    assert loss.item() == 0.0
    assert stats["count"].item() == 6 + 4  # t with x_{t+1} real and in loss_mask: row 0 t=2..7, row 1 t=2..5
    _perturb_lora(pm, scale=0.3)
    pm.eval()
    loss, stats = self_distillation_kl(pm, ids, am, lm)
    assert loss.item() > 1e-4
    # direction: KL(p_base || p_adapted) over the next-token positions
    with torch.no_grad():
        adapted = pm(input_ids=ids, attention_mask=am).logits
        with pm.disable_adapter():
            base = pm(input_ids=ids, attention_mask=am).logits
    mask = torch.zeros_like(am, dtype=torch.bool)
    mask[:, :-1] = am[:, :-1].bool() & am[:, 1:].bool() & lm[:, 1:].bool()
    want = kd_fkl(adapted[mask], base[mask]).mean()
    wrong_direction = kd_fkl(base[mask], adapted[mask]).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert abs(want.item() - wrong_direction.item()) > 1e-6
    # gradients reach the adapters only
    loss.backward()
    grads = {n: p.grad for n, p in pm.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n)


def test_medusa2_heads_read_adapted_hidden():
    """final_hidden works through the peft wrapper, and the adapted logits can be reused for the KL."""
    ids, am = batch()
    pm = add_lora(make_target(), r=4, alpha=8, dropout=0.0)
    _perturb_lora(pm)
    heads = MedusaHeads.from_target(pm, num_heads=2)
    hidden, logits = final_hidden(pm, ids, am)
    torch.testing.assert_close(heads(hidden)[0], logits, rtol=1e-6, atol=1e-6)
    loss_a, _ = self_distillation_kl(pm, ids, am, am, adapted_logits=logits)
    loss_b, _ = self_distillation_kl(pm, ids, am, am)
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6)
