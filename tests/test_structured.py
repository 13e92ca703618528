"""Grammar layer (xgrammar wrapper) and structured eval sets, on the tiny built-in target's tokenizer."""
from __future__ import annotations

import ast
import json
import re

import pytest
import torch

from drafttrain.io import DraftTrainError
from drafttrain.structured import (
    apply_mask,
    builtin_structured_examples,
    check_output,
    compile_grammar,
    decode_output,
    function_call_schema,
    parse_spec,
    read_structured_jsonl,
    validate_outputs,
)

# A bounded regex over digits and commas, and the regex of all its prefixes (written out independently, so
# the masks can be checked against Python's `re` on every token of the vocabulary).
DIGITS = r"[0-9]{1,3}(,[0-9]{1,3}){0,3}"
DIGITS_PREFIX = re.compile(r"[0-9]{0,3}|[0-9]{1,3}(,[0-9]{1,3}){0,2},[0-9]{0,3}")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "f"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}
SCHEMA_TEXT = '{"name": "f", "n": 12, "ok": true}'  # the one layout any_whitespace=False allows


@pytest.fixture(scope="module")
def tiny(tiny_builtin_target):
    from transformers import AutoConfig, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tiny_builtin_target)
    vocab = AutoConfig.from_pretrained(tiny_builtin_target).vocab_size
    return tok, vocab


@pytest.fixture(scope="module")
def model(tiny_builtin_target):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_builtin_target, dtype=torch.float32)
    return m.eval().requires_grad_(False)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _specials(tok):
    return sorted(set(tok.all_special_ids))


def _check_mask_against_matcher(g):
    """Every token the mask allows is accepted by the matcher (and can be undone); every other is rejected."""
    mask = g.allowed_mask().clone()
    before = g.num_accepted
    for t in range(g.vocab_size):
        ok = g.advance([t])
        assert ok == bool(mask[t]), (t, bool(mask[t]))
        if ok:
            g.rollback(1)
        assert g.num_accepted == before
    assert torch.equal(g.allowed_mask(), mask)
    return mask


def _complete_randomly(g, gen, max_steps=300):
    """Follow the masks with random allowed tokens until a stop token is accepted; return the tokens."""
    out = []
    for _ in range(max_steps):
        allowed = g.allowed_mask().nonzero().flatten()
        assert len(allowed), "no allowed token before the grammar terminated"
        t = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        assert g.advance([t])
        out.append(t)
        if g.is_terminated():
            return out
    raise AssertionError("the grammar did not terminate")


# ------------------------------------------------------------------------------------------------ specs


def test_parse_spec_forms_and_errors(tmp_path):
    assert parse_spec("json").kind == "json"
    r = parse_spec("regex:[a-z]+")
    assert (r.kind, r.regex, r.describe()) == ("regex", "[a-z]+", "regex:[a-z]+")
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCHEMA))
    s = parse_spec(str(path))
    assert s.kind == "json_schema" and s.schema == SCHEMA and s.describe() == f"json_schema:{path}"
    assert parse_spec(json.dumps(SCHEMA)).schema == SCHEMA
    assert parse_spec(SCHEMA).schema == SCHEMA
    with pytest.raises(DraftTrainError, match="no such file"):
        parse_spec(str(tmp_path / "missing.json"))
    with pytest.raises(DraftTrainError, match="regex:"):
        parse_spec("")
    with pytest.raises(DraftTrainError, match="empty regular expression"):
        parse_spec("regex:")
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": ')
    with pytest.raises(DraftTrainError, match=r"bad\.json:1: invalid JSON"):
        parse_spec(str(bad))
    with pytest.raises(DraftTrainError, match="invalid JSON schema at type"):
        parse_spec({"type": "integr"})
    with pytest.raises(DraftTrainError, match="must be a JSON object"):
        parse_spec(str(_write(tmp_path / "list.json", "[1]")))


def _write(path, text):
    path.write_text(text)
    return path


def test_compile_errors_are_one_line(tiny):
    tok, V = tiny
    with pytest.raises(DraftTrainError, match=r"decode.grammar \(regex:a\(\): xgrammar cannot compile it: .*parenthesis") as e:
        compile_grammar("regex:a(", tok, V)
    assert "\n" not in str(e.value)
    with pytest.raises(DraftTrainError, match=r"stop token ids \[5000\]"):
        compile_grammar("json", tok, V, stop_token_ids=[5000])


def test_config_key_composes():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import drafttrain.config as C
    from drafttrain.cli import CONF_DIR

    for value in ("json", "'regex:[0-9]+(,[0-9]+)*'", "/data/schema.json"):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="eval", overrides=[f"decode.grammar={value}"])
        obj = OmegaConf.to_object(cfg)
        assert isinstance(obj, C.EvalJob) and obj.decode.grammar == value.strip("'")
    assert C.DecodeConfig().grammar is None


# ------------------------------------------------------------------------------------------------ masks


def test_regex_masks_match_python_re_on_every_token(tiny):
    tok, V = tiny
    g = compile_grammar(f"regex:{DIGITS}", tok, V).state()
    texts = [tok.decode([t], clean_up_tokenization_spaces=False) for t in range(V)]
    specials = set(_specials(tok))
    eos = tok.eos_token_id
    prefix = ""
    # walk a valid output token by token; at every state compare the mask with an independent prefix check
    for t in [*_ids(tok, "12,345,6"), None]:
        mask = _check_mask_against_matcher(g)
        expect = torch.tensor(
            [i not in specials and bool(texts[i]) and DIGITS_PREFIX.fullmatch(prefix + texts[i]) is not None
             for i in range(V)]
        )
        complete = re.fullmatch(DIGITS, prefix) is not None
        expect[eos] = complete  # the stop token: exactly when the text so far is a full match
        assert torch.equal(mask, expect), (prefix, (mask != expect).nonzero().flatten()[:10].tolist())
        assert g.is_completed() == complete
        if t is not None:
            assert g.advance([t])
            prefix += texts[t]
    assert prefix == "12,345,6"


@pytest.mark.parametrize("spec", ["regex", "schema", "json"])
def test_allowed_tokens_complete_to_valid_outputs(tiny, spec):
    """Independent of xgrammar: a random grammatical continuation of any allowed token validates."""
    tok, V = tiny
    grammar = {"regex": f"regex:{DIGITS}", "schema": SCHEMA, "json": "json"}[spec]
    text = {"regex": "12,345,6", "schema": SCHEMA_TEXT, "json": '{"a": [1, 2]}'}[spec]
    g = compile_grammar(grammar, tok, V).state()
    gen = torch.Generator().manual_seed(0)
    eos = tok.eos_token_id
    done: list[int] = []
    for t in _ids(tok, text):
        mask = _check_mask_against_matcher(g)
        assert not mask[[s for s in _specials(tok) if s != eos]].any()  # specials are never grammar text
        allowed = mask.nonzero().flatten()
        # a few allowed tokens per state (the built-in JSON grammar is unbounded: its masks are checked above)
        for k in ([] if spec == "json" else torch.randperm(len(allowed), generator=gen)[:4].tolist()):
            branch = g.fork()
            first = int(allowed[k])
            assert branch.advance([first])
            rest = [] if branch.is_terminated() else _complete_randomly(branch, gen)
            full = decode_output(tok, done + [first] + rest, [eos])
            assert check_output(full, grammar) is None, full
        assert g.advance([t])
        done.append(t)
    assert g.is_completed() and check_output(text, grammar) is None
    assert decode_output(tok, done + [eos, 7], [eos]) == text


def test_stop_token_only_when_complete_and_alone_at_the_end(tiny):
    tok, V = tiny
    eos = tok.eos_token_id
    g = compile_grammar(SCHEMA, tok, V).state()
    ids = _ids(tok, SCHEMA_TEXT)
    for k, t in enumerate(ids):
        assert not g.allowed(eos) and not g.is_completed(), k  # the object is open until its last token
        assert g.advance([t])
    assert g.is_completed() and not g.is_terminated()
    assert g.allowed_mask().nonzero().flatten().tolist() == [eos]  # nothing can extend a closed object
    logits = torch.randn(2, V)
    masked = g.mask(logits)
    assert torch.isfinite(masked).sum().item() == 2 and torch.equal(masked[:, eos], logits[:, eos])
    assert g.advance([eos]) and g.is_terminated() and g.num_accepted == len(ids) + 1
    assert not g.allowed_mask().any() and not g.advance([eos])  # terminated: nothing more
    g.rollback(1)
    assert not g.is_terminated() and g.allowed_mask().nonzero().flatten().tolist() == [eos]
    # several stop tokens (the decoder's eos set): each one ends the output
    end_of_turn = tok.convert_tokens_to_ids("<|user|>")
    g2 = compile_grammar(SCHEMA, tok, V, stop_token_ids=[eos, end_of_turn]).state()
    assert g2.advance(ids) and g2.allowed_mask().nonzero().flatten().tolist() == sorted([eos, end_of_turn])


def test_logits_wider_than_the_tokenizer(tiny):
    tok, V = tiny
    wide = V + 40  # lm_head padded beyond the tokenizer's vocabulary
    g = compile_grammar(f"regex:{DIGITS}", tok, wide).state()
    mask = g.allowed_mask()
    assert mask.shape == (wide,) and mask.any() and not mask[V:].any()
    assert not g.advance([V + 3]) and not g.advance([-1]) and g.num_accepted == 0
    assert g.mask(torch.zeros(wide))[V:].eq(float("-inf")).all()
    with pytest.raises(ValueError, match="logits width"):
        g.mask(torch.zeros(V))
    narrow = compile_grammar(f"regex:{DIGITS}", tok, V).state()
    assert torch.equal(mask[:V], narrow.allowed_mask())


def test_advance_rollback_round_trip(tiny):
    tok, V = tiny
    g = compile_grammar(SCHEMA, tok, V).state()
    ids = _ids(tok, SCHEMA_TEXT)
    seen = [g.allowed_mask().clone()]
    for t in ids:
        assert g.advance([t])
        seen.append(g.allowed_mask().clone())
    assert len({tuple(m.nonzero().flatten().tolist()) for m in seen}) > 3  # the masks do change on the way
    for k in range(len(ids), 0, -1):
        g.rollback(1)
        assert g.num_accepted == k - 1 and torch.equal(g.allowed_mask(), seen[k - 1]), k
    assert g.advance(ids[:5]) and torch.equal(g.allowed_mask(), seen[5])
    g.rollback(3)
    assert torch.equal(g.allowed_mask(), seen[2])
    # all or nothing: a sequence with an ungrammatical token leaves the state untouched
    bad = ids[2:6] + _ids(tok, "}")
    assert not g.advance(bad) and g.num_accepted == 2 and torch.equal(g.allowed_mask(), seen[2])
    with pytest.raises(ValueError, match="rollback"):
        g.rollback(3)
    with g.scratch():
        assert g.advance(ids[2:9]) and g.num_accepted == 9
    assert g.num_accepted == 2 and torch.equal(g.allowed_mask(), seen[2])
    g.reset()
    assert g.num_accepted == 0 and torch.equal(g.allowed_mask(), seen[0])


def test_masks_along_equals_step_by_step_and_restores(tiny):
    tok, V = tiny
    g = compile_grammar(SCHEMA, tok, V).state()
    ids = _ids(tok, SCHEMA_TEXT)
    assert g.advance(ids[:3])
    draft = ids[3:9]
    dm = g.masks_along(draft)
    assert dm.masks.shape == (len(draft) + 1, V) and dm.valid.all() and dm.num_valid_prefix == len(draft)
    assert g.num_accepted == 3
    ref = g.fork()
    for j, t in enumerate(draft):
        assert torch.equal(dm.masks[j], ref.allowed_mask()), j
        assert ref.advance([t])
    assert torch.equal(dm.masks[-1], ref.allowed_mask())
    assert torch.equal(g.allowed_mask(), dm.masks[0]) and g.num_accepted == 3  # the state was left as it was
    # an ungrammatical draft token: valid stops there, the rows after it allow nothing
    bad = draft[:2] + _ids(tok, "]") + draft[3:]
    dm2 = g.masks_along(bad)
    assert dm2.valid.tolist() == [True, True] + [False] * (len(bad) - 2) and dm2.num_valid_prefix == 2
    assert torch.equal(dm2.masks[:3], dm.masks[:3]) and not dm2.masks[3:].any()
    assert g.num_accepted == 3
    # a draft that reaches the stop token: nothing is allowed after it
    full = ids[3:] + [tok.eos_token_id]
    dm3 = g.masks_along(full)
    assert dm3.valid.all() and dm3.masks[-2].nonzero().flatten().tolist() == [tok.eos_token_id]
    assert not dm3.masks[-1].any() and g.num_accepted == 3 and not g.is_terminated()


def test_tree_masks_match_each_path(tiny):
    tok, V = tiny
    g = compile_grammar(f"regex:{DIGITS}", tok, V).state()
    assert g.advance(_ids(tok, "1"))
    t = {s: _ids(tok, s) for s in ("2", "3", ",", "4", "x")}
    assert all(len(v) == 1 for v in t.values())
    t = {s: v[0] for s, v in t.items()}
    # root -> "2" -> ("3" -> ",", ","), root -> "," -> "4", root -> "x" (invalid) -> "2" (child of invalid)
    tokens = [t["2"], t[","], t["3"], t[","], t[","], t["4"], t["x"], t["2"]]
    parents = [-1, -1, 0, 0, 2, 1, -1, 6]
    tm = g.tree_masks(tokens, parents)
    assert tm.valid.tolist() == [True, True, True, True, True, True, False, False]
    for i in range(len(tokens)):
        path, p = [], i
        while p != -1:
            path.append(tokens[p])
            p = parents[p]
        ref = g.fork()
        if not ref.advance(path[::-1]):
            assert not tm.masks[i + 1].any()
            continue
        assert torch.equal(tm.masks[i + 1], ref.allowed_mask()), i
    assert torch.equal(tm.masks[0], g.allowed_mask()) and g.num_accepted == 1
    # "123" is complete: after it a digit is not allowed, a comma or the stop token is
    m123 = tm.masks[3]
    assert m123[tok.eos_token_id] and m123[t[","]] and not m123[t["4"]]
    with pytest.raises(ValueError, match="topological"):
        g.tree_masks([t["2"], t["3"]], [1, -1])


def test_fork_is_independent(tiny):
    tok, V = tiny
    g = compile_grammar(SCHEMA, tok, V).state()
    ids = _ids(tok, SCHEMA_TEXT)
    assert g.advance(ids[:4])
    f = g.fork()
    assert f.num_accepted == 4 and torch.equal(f.allowed_mask(), g.allowed_mask())
    assert f.advance(ids[4:8])
    assert g.num_accepted == 4 and not torch.equal(f.allowed_mask(), g.allowed_mask())
    g.rollback(4)
    assert f.num_accepted == 8 and f.advance(ids[8:])


def test_apply_mask_broadcasts():
    logits = torch.arange(12.0).view(2, 6)
    allowed = torch.tensor([True, False, True, False, False, True])
    out = apply_mask(logits, allowed)
    assert torch.equal(out.isfinite(), allowed.expand(2, 6)) and torch.equal(out[:, allowed], logits[:, allowed])
    assert logits.isfinite().all()  # not in place
