"""Fixtures for server tests: an in-process server, a client, a raw stub, started processes."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import grpc
import pytest
from svc_util import Live, Proc, start_live

from hkv_service.client import MetadataClient
from hkv_service.proto_gen.hkv.v1 import hkv_pb2_grpc as pb_grpc


@pytest.fixture
def live() -> Iterator[Live]:
    lv = start_live()
    yield lv
    lv.service.stop(0).wait()


@pytest.fixture
def client(live: Live) -> Iterator[MetadataClient]:
    with MetadataClient(live.endpoint, timeout_s=5.0) as c:
        yield c


@pytest.fixture
def stub(live: Live) -> Iterator[pb_grpc.MetadataServiceStub]:
    with grpc.insecure_channel(live.endpoint) as ch:
        yield pb_grpc.MetadataServiceStub(ch)  # type: ignore[no-untyped-call]


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop(signal.SIGKILL)
