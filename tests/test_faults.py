"""`STEPGRPO_FAULT`: a fault fires once, at its stage and row, from the environment or from a file."""

from __future__ import annotations

import pytest

from stepgrpo.runtime.faults import InjectedFault, maybe_fail


def test_a_fault_fires_once_at_its_stage_and_row(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPGRPO_FAULT", f"raise:rollout:6:{tmp_path / 'fired'}")
    maybe_fail("rollout", 0)
    maybe_fail("complete", 6)
    with pytest.raises(InjectedFault, match="rollout shard at row 6"):
        maybe_fail("rollout", 6)
    maybe_fail("rollout", 6)  # its marker exists now


def test_a_fault_read_from_a_file_changes_with_the_file(tmp_path, monkeypatch):
    spec = tmp_path / "fault"
    monkeypatch.setenv("STEPGRPO_FAULT", f"@{spec}")
    maybe_fail("rollout", 6)  # no file: no fault
    spec.write_text("")
    maybe_fail("rollout", 6)  # an empty file: no fault
    spec.write_text(f"raise:complete:12:{tmp_path / 'first'}\n")
    maybe_fail("rollout", 6)
    with pytest.raises(InjectedFault, match="complete shard at row 12"):
        maybe_fail("complete", 12)
    spec.write_text(f"raise:rollout:6:{tmp_path / 'second'}")
    with pytest.raises(InjectedFault, match="rollout shard at row 6"):
        maybe_fail("rollout", 6)
