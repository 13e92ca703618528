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


def test_unpack_bitmask_and_xgrammar_apply_agree(tiny):
    import xgrammar

    from drafttrain.structured import unpack_bitmask

    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=gen)
    ref = torch.tensor([[(int(w) >> b) & 1 for w in row for b in range(32)] for row in packed.tolist()]).bool()
    assert torch.equal(unpack_bitmask(packed, 150), ref[:, :150])  # numpy path (CPU)
    assert torch.equal(unpack_bitmask(packed.view(-1, 5)[:1].clone(), 160), ref[:1])
    tok, V = tiny
    g = compile_grammar(SCHEMA, tok, V).state()
    dm = g.masks_along(_ids(tok, SCHEMA_TEXT)[:5])
    assert torch.equal(unpack_bitmask(dm.bitmasks, V), dm.masks) and torch.equal(g.bitmask(), dm.bitmasks[0])
    logits = torch.randn(6, V)
    via_xgr = logits.clone()
    xgrammar.apply_token_bitmask_inplace(via_xgr, dm.bitmasks)
    assert torch.equal(via_xgr, apply_mask(logits, dm.masks))


def test_apply_mask_broadcasts():
    logits = torch.arange(12.0).view(2, 6)
    allowed = torch.tensor([True, False, True, False, False, True])
    out = apply_mask(logits, allowed)
    assert torch.equal(out.isfinite(), allowed.expand(2, 6)) and torch.equal(out[:, allowed], logits[:, allowed])
    assert logits.isfinite().all()  # not in place


# ------------------------------------------------------------------------------------------- eval sets


def test_function_call_schema_types():
    src = (
        "def f(self, a, b=2, /, c: int = 3, *, d: float = 1.0, e: 'list[int] | None' = None,\n"
        "      g: Optional[str] = None, flag=False, name='x', h=None, **kw):\n    pass"
    )
    schema = function_call_schema(ast.parse(src).body[0], max_string_length=8)
    assert schema["properties"]["name"] == {"const": "f"}
    args = schema["properties"]["arguments"]
    assert args["required"] == ["a"] and args["additionalProperties"] is False
    p = args["properties"]
    assert list(p) == ["a", "b", "c", "d", "e", "g", "flag", "name", "h"]  # self and **kw left out, order kept
    assert p["a"] == {"type": "string", "maxLength": 8}
    assert p["b"]["type"] == "integer" and p["c"]["type"] == "integer" and p["d"]["type"] == "number"
    assert p["e"]["anyOf"][0]["type"] == "array" and p["e"]["anyOf"][1] == {"type": "null"}
    assert p["g"]["anyOf"][0] == {"type": "string", "maxLength": 8}
    assert p["flag"] == {"type": "boolean"} and p["name"]["type"] == "string"
    assert p["h"] == {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}
    call = {"name": "f", "arguments": {"a": "hi", "b": -3, "d": 0.5, "e": None, "g": "s", "flag": True}}
    assert check_output(json.dumps(call), schema) is None
    for bad in ({"name": "g", "arguments": {"a": "x"}}, {"name": "f", "arguments": {"b": 1}},
                {"name": "f", "arguments": {"a": "x", "zz": 1}}, {"name": "f", "arguments": {"a": "x" * 9}},
                {"name": "f", "arguments": {"a": "x", "b": 1.5}}):
        assert check_output(json.dumps(bad), schema) is not None, bad
    assert "not JSON" in check_output('{"name": "f"', schema)


def _minimal_instance(schema):
    if "const" in schema:
        return schema["const"]
    if "anyOf" in schema:
        return None
    t = schema["type"]
    if t == "object":
        return {k: _minimal_instance(schema["properties"][k]) for k in schema["required"]}
    return {"string": "s", "integer": 0, "number": 0.5, "boolean": True, "array": [], "null": None}[t]


@pytest.mark.slow
def test_builtin_structured_examples(tiny):
    tok, _ = tiny
    ex = builtin_structured_examples(limit=40, seed=0)
    assert [e.id for e in ex] == [e.id for e in builtin_structured_examples(limit=40, seed=0)]
    assert [e.id for e in ex] != [e.id for e in builtin_structured_examples(limit=40, seed=1)]
    assert len({e.id for e in ex}) == 40 and all(e.id.split(":")[0].endswith(".py") for e in ex)
    for e in ex:
        parse_spec(e.schema)  # a valid JSON schema
        name = e.schema["properties"]["name"]["const"]
        assert e.meta["function"] == name and f"`{name}`" in e.messages[0]["content"]
        assert json.dumps(e.schema, separators=(",", ":")) in e.messages[0]["content"]
        assert f"def {name}(" in e.messages[0]["content"]
        assert e.schema["properties"]["arguments"]["properties"]  # at least one parameter
        good = _minimal_instance(e.schema)
        assert e.check(json.dumps(good)) is None
        if e.meta["required"]:
            del good["arguments"][e.meta["required"][0]]
            assert e.check(json.dumps(good)) is not None
        ids = e.prompt_ids(tok)
        assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>") and ids.count(tok.eos_token_id) == 1
    with pytest.raises(DraftTrainError, match="split='nope'"):
        builtin_structured_examples(split="nope")
    with pytest.raises(DraftTrainError, match="asked for 100000"):
        builtin_structured_examples(limit=100000)


def test_read_structured_jsonl(tmp_path, tiny):
    tok, _ = tiny
    rows = [
        {"messages": [{"role": "user", "content": "a point"}], "schema": SCHEMA, "id": "p1"},
        {"messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": SCHEMA_TEXT}], "schema": {"type": "integer"}},
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ex = read_structured_jsonl(path)
    assert [e.id for e in ex] == ["p1", None] and ex[0].schema == SCHEMA and ex[1].where == f"{path}:2"
    assert ex[1].prompt_messages == rows[1]["messages"][:2]  # the reference answer is not prompted
    assert ex[1].prompt_ids(tok) == ex[1].prompt_ids(tok) and tok.decode(ex[1].prompt_ids(tok)).endswith("q<|end|><|assistant|>")
    assert validate_outputs(["12", SCHEMA_TEXT], ex[::-1])["valid_fraction"] == 1.0
    r = validate_outputs([SCHEMA_TEXT, "1.5"], ex)
    assert (r["num_valid"], r["num"], r["failures"][0]["id"]) == (1, 2, None)
    bad_rows = [
        ({"messages": [{"role": "user", "content": "x"}]}, 'no "schema" key'),
        ({"messages": [{"role": "user", "content": "x"}], "schema": {"type": "intger"}}, "invalid JSON schema"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "schema": SCHEMA},
         "must end with a user turn"),
        ({"messages": [{"role": "bot", "content": "x"}], "schema": SCHEMA}, "unknown role 'bot'"),
    ]
    for row, needle in bad_rows:
        p = tmp_path / "bad.jsonl"
        p.write_text(json.dumps(rows[0]) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(DraftTrainError, match=re.escape(f"{p}:2") + ".*" + re.escape(needle)):
            read_structured_jsonl(p)


# ------------------------------------------------------------------- constrained greedy decoding (reference)


def _constrained_greedy(model, g, prompt, stops, max_new_tokens):
    """The reference for phase 2: plain HF forwards (prefill, then one token at a time over an HF cache),
    argmax of the grammar-masked logits, the grammar state advanced over each chosen token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    inp, out, changed = torch.tensor([prompt]), [], 0
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=inp, cache=cache, use_cache=True).logits[0, -1]
            t = int(g.mask(logits).argmax())
            changed += int(t != int(logits.argmax()))
            assert g.advance([t]), t  # the masked argmax is always grammatical
            out.append(t)
            if t in stops:
                break
            inp = torch.tensor([[t]])
    return out, changed


@pytest.mark.slow
def test_constrained_greedy_decode_validates(tiny, model):
    tok, V = tiny
    eos = tok.eos_token_id
    examples = [e for e in builtin_structured_examples(limit=60, seed=0, max_string_length=8)
                if len(e.schema["properties"]["arguments"]["properties"]) <= 2][:3]
    texts, total_changed = [], 0
    for e in examples:
        g = compile_grammar(e.schema, tok, V, stop_token_ids=[eos]).state()
        out, changed = _constrained_greedy(model, g, e.prompt_ids(tok), {eos}, max_new_tokens=120)
        assert g.is_terminated() and out[-1] == eos, decode_output(tok, out)  # the grammar ended it
        texts.append(decode_output(tok, out, [eos]))
        total_changed += changed
    report = validate_outputs(texts, examples)
    assert report["valid_fraction"] == 1.0, report
    assert total_changed > 0  # the grammar did change the target's choices (the tiny target is no JSON writer)
    # a regex-constrained answer to a plain prompt
    from drafttrain.data.chat import prompt_ids

    g = compile_grammar(f"regex:{DIGITS}", tok, V).state()
    out, _ = _constrained_greedy(model, g, prompt_ids(tok, [{"role": "user", "content": "def f(x):"}]), {eos}, 40)
    assert out[-1] == eos and check_output(decode_output(tok, out, [eos]), f"regex:{DIGITS}") is None
