"""The test-only fault hook the process tests act through (kfed_spark.runtime.fault_injection)."""

import os

import pytest

from kfed_spark.errors import KFedError
from kfed_spark.runtime.fault_injection import FAULT_ENV, point

pytestmark = pytest.mark.fast


def test_faults_separated_by_semicolons_each_act_at_their_own_point(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    gate.touch()  # open: the wait returns at once, after saying it waited
    monkeypatch.setenv(FAULT_ENV, f"wait:checked:{gate};fail:labels")
    point("claimed")
    assert not list(tmp_path.glob("gate.*"))
    point("checked")
    assert [path.name for path in tmp_path.glob("gate.*")] == [f"gate.{os.getpid()}"]
    with pytest.raises(KFedError, match="injected failure at labels"):
        point("labels")
