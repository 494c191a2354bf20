"""Prometheus exports what ``hkv stats`` shows: admission refusals and the in-transit peak
beside the gauges (regression, issue 17 item 8: neither was exported)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from hkv_service.core.api import AdmissionCap, StateConfig
from hkv_service.core.errors import AdmissionRefused
from hkv_service.core.ids import ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.server.metrics import make_registry
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes


def test_refusals_peak_and_ticket_holders_are_exported() -> None:
    st = CacheState(default_spec(), StateConfig(admission=AdmissionCap(1, 1 << 30)))
    st.register_owner(ShardId("s0"), pools_for(st.layout, 16))
    ids = commit_prefix(st, prompt_hashes(st.spec, 2))
    st.begin_offload(ids[(0, "c4")], ShardId("s0"))  # holds the one ticket
    with pytest.raises(AdmissionRefused):
        st.begin_offload(ids[(1, "c4")], ShardId("s0"))
    text = generate_latest(make_registry(st)).decode()
    assert "hkv_admission_refused_total 1.0" in text
    assert "hkv_in_transit_peak_objects 1.0" in text
    assert 'hkv_in_transit_by_state{state="OFFLOADING"} 1.0' in text
