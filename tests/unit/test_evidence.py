"""One rule per decision that trusts records in Kafka (cdc.evidence), asked where it decides.

The rules' judgements are tested where each decision is (test_slot_gap.py: the
lineage; test_exactly_once_pure.py: the checkpoint; test_audit_core.py: the
audit's read); here: the table is whole, each rule says what the table says, and
no decision makes an owner or compares an origin of its own.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from cdc import evidence
from cdc.evidence import RULES, Decision, Origin, Rule
from cdc.wal.slots import ServerIdentity
from tests.unit.test_import_graph import ROOT

SERVER = ServerIdentity("7301", 3, ((1, 0x3000060), (2, 0x4000000)))
SLOT = "outbox_slot"

#: decision -> (its rule function, the modules that must ask it)
ASKED = {
    Decision.GAP_DETECTION: (
        "gap_rule",
        ["cdc/relay/gaps/recovery.py", "cdc/relay/delivery/eos_start.py", "cdc/retention.py"],
    ),
    Decision.RECOVERY: ("recovery_rule", ["cdc/relay/gaps/recovery.py", "cdc/repair/republish.py"]),
    Decision.AUDIT: ("audit_rule", ["cdc/audit/run.py"]),
    Decision.CHECKPOINT: ("checkpoint_rule", ["cdc/relay/delivery/checkpoint.py"]),
    Decision.DEAD_LETTERS: (
        "dead_letter_rule",
        ["cdc/audit/kafka.py", "cdc/repair/transactional.py"],
    ),
}


def _calls(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    return {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    }


def test_every_decision_has_one_rule_and_the_docstring_table_names_each() -> None:
    assert set(RULES) == set(Decision) == set(ASKED)
    doc = evidence.__doc__ or ""
    for decision, (function, _) in ASKED.items():
        assert decision.value in doc, f"the table lacks {decision.value}"
        assert f":func:`{function}`" in doc
        assert callable(getattr(evidence, function))


@pytest.mark.parametrize("decision", list(Decision), ids=lambda d: d.name)
def test_each_decision_asks_its_rule_where_it_decides(decision: Decision) -> None:
    function, modules = ASKED[decision]
    for module in modules:
        assert function in _calls(module), f"{module} decides {decision.value} without {function}"


def test_no_decision_makes_an_owner_or_compares_an_origin_of_its_own() -> None:
    """Owner.of is made in cdc.evidence only; no module compares an origin header to
    an origin text by hand (the checkpoint's exact match is a rule too)."""
    made = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "cdc").rglob("*.py")
        if path.name != "evidence.py" and "Owner.of(" in path.read_text(encoding="utf-8")
    )
    assert not made, f"owners made outside cdc.evidence: {made}"
    by_hand = re.compile(r"origin\s*[!=]=\s*origin\.encode\(\)")
    compared = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "cdc").rglob("*.py")
        if path.name != "evidence.py" and by_hand.search(path.read_text(encoding="utf-8"))
    )
    assert not compared, f"origins compared by hand: {compared}"


def test_the_rules_judge_as_the_table_says() -> None:
    own = str(Origin("7301", 2, SLOT))  # (an ancestor timeline of the lineage)
    foreign = Origin("9999", 3, SLOT)
    for make in (evidence.gap_rule, evidence.recovery_rule):
        owner = make(SERVER, SLOT)
        assert owner.owns(Origin("7301", 3, SLOT)) and owner.owns(Origin.parse(own))  # type: ignore[arg-type]
        assert not owner.owns(foreign) and not owner.owns(Origin("7301", 3, "other"))
    assert RULES[Decision.GAP_DETECTION] is RULES[Decision.RECOVERY] is Rule.LINEAGE
    audit = evidence.audit_rule(SERVER, SLOT)
    assert audit is not None and audit.owns(Origin("7301", 1, SLOT))
    assert evidence.audit_rule(None, SLOT) is None  # the server unknown: any origin vouches
    current = str(Origin("7301", 3, SLOT))
    assert evidence.checkpoint_rule(current.encode(), current) is None
    assert evidence.checkpoint_rule(own.encode(), current) == (
        "another origin header (not written by this relay)"
    )  # (an ancestor's checkpoint is judged under its own origin, never this one's)
    assert evidence.checkpoint_rule(None, current) == "no origin header (not written by this relay)"
    assert evidence.dead_letter_rule(b"\x01" * 16) and not evidence.dead_letter_rule(None)


def test_the_module_lives_at_the_kernel_level() -> None:
    """cdc.evidence imports neither the relay nor the audit: both ask it."""
    source = Path(evidence.__file__).read_text(encoding="utf-8")
    assert "cdc.relay" not in source.split('"""', 2)[2]
    assert "cdc.audit" not in source.split('"""', 2)[2]
