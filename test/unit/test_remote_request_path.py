"""The weight-sync group's request path, as each base's patch hooks it into SGLang
(0.5.23: patch 0009; 0.5.12 and 0.5.10.post1: patch 0008), checked against the installed
wheel without an engine: the request types, the Engine methods, the HTTP routes and the
server adapter, the scheduler's dispatcher, the tokenizer manager's communicators and
methods, and the release differences the engine side goes through (``sglang_compat``).
The update itself runs in ``test/e2e/test_remote_engines.py`` (and, on the older bases, in
their smokes: verl's checkpoint engine, AReaL's companion patch).
"""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest

import sglang.srt.managers.io_struct as io
from sglang.srt.weight_sync.sglang_compat import (
    field_names,
    replace_fields,
    settle_weight_update,
)

REQUESTS = {
    "join_weight_sync_group": "JoinWeightSyncGroup",
    "update_weights_remote": "UpdateWeightsRemote",
    "leave_weight_sync_group": "LeaveWeightSyncGroup",
}
JOIN = dict(
    group_name="g",
    master_address="127.0.0.1",
    master_port=29500,
    rank_offset=4,
    world_size=6,
    epoch=2,
    backend="gloo",
    timeout_s=30.0,
)


def test_request_types_and_their_fields():
    join = io.JoinWeightSyncGroupReqInput(**JOIN)
    assert {f: getattr(join, f) for f in JOIN} == JOIN
    update = io.UpdateWeightsRemoteReqInput(group_name="g")
    assert (update.step, update.update_id, update.flush_cache) == ("update", None, True)
    assert (update.outcome_channel, update.outcome_id) == (None, None)
    out = io.UpdateWeightsRemoteReqOutput(success=True, message="Success")
    assert (out.state, out.mixed, out.bytes_received, out.apply_us) == (
        "",
        False,
        [],
        [],
    )
    for fields in ("bytes_received", "lower_bound_bytes", "receive_us", "apply_us"):
        assert fields in field_names(io.UpdateWeightsRemoteReqOutput)
    io.LeaveWeightSyncGroupReqOutput(success=False, message="no such group")


def test_replace_fields_copies_the_release_request_kind():
    update = io.UpdateWeightsRemoteReqInput(group_name="g", timeout_s=9.0)
    step = replace_fields(update, step="apply", outcome_id="u#1")
    assert type(step) is type(update)
    assert (step.step, step.outcome_id, step.timeout_s) == ("apply", "u#1", 9.0)
    assert update.step == "update"  # the original is left as it was


@pytest.mark.parametrize("method", sorted(REQUESTS))
def test_engine_method_builds_the_request(method):
    from sglang.srt.entrypoints.engine import Engine

    seen = []

    class FakeTokenizerManager:
        pass

    async def answer(obj, request):
        seen.append((obj, request))
        return {"success": True, "message": "Success"}

    tokenizer_manager = FakeTokenizerManager()
    setattr(tokenizer_manager, method, answer)
    engine = SimpleNamespace(
        loop=asyncio.new_event_loop(), tokenizer_manager=tokenizer_manager
    )
    kwargs = {
        "join_weight_sync_group": JOIN,
        "update_weights_remote": dict(group_name="g", update_id="u", timeout_s=7.0),
        "leave_weight_sync_group": dict(group_name="g"),
    }[method]
    try:
        result = getattr(Engine, method)(engine, **kwargs)
    finally:
        engine.loop.close()
    assert result == {"success": True, "message": "Success"}
    ((obj, request),) = seen
    assert request is None
    assert type(obj) is getattr(io, REQUESTS[method] + "ReqInput")
    assert {k: getattr(obj, k) for k in kwargs} == kwargs


def test_http_routes_and_server_adapter(monkeypatch):
    import requests

    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.entrypoints.http_server_engine import HttpServerEngineAdapter

    paths = {getattr(route, "path", None) for route in app.routes}
    assert {f"/{m}" for m in REQUESTS} <= paths, sorted(p for p in paths if p)
    posted = []

    def post(url, json, **kwargs):
        posted.append((url, json))
        return SimpleNamespace(status_code=400, json=lambda: {"success": False})

    monkeypatch.setattr(requests, "post", post)
    adapter = object.__new__(HttpServerEngineAdapter)
    adapter.server_args = SimpleNamespace(  # what each release's SSL check reads
        url=lambda: "http://h:1",
        ssl_verify=lambda: True,
        ssl_ca_certs=None,
        ssl_certfile=None,
    )
    assert adapter.join_weight_sync_group(**JOIN) == {"success": False}
    adapter.update_weights_remote(group_name="g")
    adapter.leave_weight_sync_group("g")
    assert posted == [
        ("http://h:1/join_weight_sync_group", JOIN),
        ("http://h:1/update_weights_remote", {"group_name": "g"}),
        ("http://h:1/leave_weight_sync_group", {"group_name": "g"}),
    ]


def test_scheduler_dispatches_the_three_requests_to_the_engine_side():
    import sglang.srt.managers.scheduler as scheduler

    compact = "".join(
        inspect.getsource(scheduler.Scheduler.init_request_dispatcher).split()
    )
    for name in REQUESTS.values():
        assert f"({name}ReqInput," in compact, name
        assert getattr(scheduler, f"{name}ReqInput") is getattr(io, f"{name}ReqInput")
    # 0.5.23's weight updater or the older releases' scheduler mixin hands them over
    holder = (
        "self.weight_updater.weight_sync_group"
        if "self.weight_updater.weight_sync_group" in compact
        else "self.weight_sync_group"
    )
    assert compact.count(holder) == 3


def test_tokenizer_manager_declares_communicators_and_methods():
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    module = inspect.getsource(inspect.getmodule(TokenizerManager.init_communicators))
    for method, name in REQUESTS.items():
        assert inspect.iscoroutinefunction(getattr(TokenizerManager, method)), method
        # a (name, output type) spec (0.5.23, 0.5.12) or an attribute of its own (0.5.10.post1)
        assert (
            f'("{method}", {name}ReqOutput)' in module
            or f"self.{method}_communicator = " in module
        ), method
        assert f"{name}ReqOutput" in module


class _Updater:
    """0.5.23's scheduler weight-updater manager: version and flush its own steps."""

    def __init__(self, flushed=True):
        self.flushed, self.events = flushed, []

    def record_weight_version_after_update(self, version):
        self.events.append(("version", version))

    def flush_cache_after_weight_update(self, recv_req, success, message):
        self.events.append("flush")
        return (success, message) if self.flushed else (False, "not flushed")


def test_settle_weight_update_records_the_version_and_flushes():
    req = SimpleNamespace(weight_version="v3", flush_cache=True)
    updater = _Updater()
    assert settle_weight_update(updater, req, True, "Success") == (True, "Success")
    assert updater.events == [("version", "v3"), "flush"]


# pr: here
class _OlderScheduler:
    """0.5.10.post1 / 0.5.12's scheduler: flush_cache() only (the version is the tokenizer's)."""

    def __init__(self, flushed=True):
        self.flushed, self.events = flushed, []

    def flush_cache(self):
        self.events.append("flush")
        return self.flushed


def test_settle_weight_update_on_older_schedulers_flushes_only():
    req = SimpleNamespace(weight_version="v3", flush_cache=True)
    older = _OlderScheduler()
    assert settle_weight_update(older, req, True, "Success") == (True, "Success")
    assert older.events == ["flush"]
    refused = _OlderScheduler(flushed=False)
    ok, message = settle_weight_update(refused, req, True, "Success")
    assert not ok and "cache was not flushed" in message
    no_flush = _OlderScheduler()
    req = SimpleNamespace(weight_version=None, flush_cache=False)
    assert settle_weight_update(no_flush, req, True, "Success") == (True, "Success")
    assert no_flush.events == []


# pr: here end
