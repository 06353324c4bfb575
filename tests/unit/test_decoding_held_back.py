"""Why a slot named in ``synchronized_standby_slots`` holds a failover slot's logical
decoding back (issue 49, item 2): each cause PostgreSQL 17+ waits on, one line each.

The pure verdict, case by case (the real server's rows are read by
``test_failover_slots.py::test_each_kind_of_standby_slot_that_holds_decoding_back_is_named``
on PostgreSQL 18).
"""

from __future__ import annotations

import pytest

from cdc.wal.slots import standby_slot_names, why_held_back


@pytest.mark.parametrize(
    ("kind", "active", "invalid", "behind", "held"),
    [
        (None, False, False, False, "does not exist"),  # a promoted standby's copied setting
        ("logical", True, False, False, "is a logical slot, not a standby's physical slot"),
        ("physical", True, True, False, "is invalidated"),  # invalidated wins over active
        ("physical", False, True, True, "is invalidated"),
        ("physical", False, False, True, "has no standby streaming from it and is behind"),
        ("physical", False, False, False, None),  # nobody streams, but nothing to wait for
        ("physical", True, False, True, None),  # a standby streams: it will confirm
        ("physical", True, False, False, None),
    ],
)
def test_each_cause_is_named_and_a_healthy_standby_slot_is_not(
    kind: str | None, active: bool, invalid: bool, behind: bool, held: str | None
) -> None:
    why = why_held_back(kind, active=active, invalid=invalid, behind=behind)
    if held is None:
        assert why is None
    else:
        assert why is not None and held in why


def test_the_settings_names_are_read_as_the_server_lists_them() -> None:
    assert standby_slot_names('a, "B" ,,c') == ["a", "B", "c"]
    assert standby_slot_names("") == []
    assert standby_slot_names("*") == ["*"]
