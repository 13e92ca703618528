"""scripts/lab/peer_speculators.py's bookkeeping (the training rows need speculators and run as a benchmark)."""
from __future__ import annotations

import importlib.util

from .conftest import REPO


def _script():
    spec = importlib.util.spec_from_file_location("peer_speculators", REPO / "scripts" / "lab" / "peer_speculators.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_spec_same_row_with_another_loss_never_reuses_the_kl_div_run():
    peer = _script()
    assert peer.run_name("spec_same", "kl_div") == "spec_same"
    names = {peer.run_name("spec_same", loss) for loss in ("ce", "tv", "reverse_kl", '{"ce": 0.5, "kl_div": 0.5}')}
    assert "spec_same" not in names and len(names) == 4
    assert all("/" not in n and " " not in n for n in names)
    assert peer.run_name("drafttrain", "ce") == "drafttrain"  # --spec-loss touches only the spec_same row


def test_result_rows_are_told_apart_by_their_loss():
    peer = _script()
    assert peer._loss_of({"row": "spec_same"}) == "kl_div"  # rows written before --spec-loss
    assert peer._loss_of({"row": "spec_same", "spec_loss": "ce"}) == "ce"
    assert peer._loss_of({"row": "drafttrain", "spec_loss": None}) is None
