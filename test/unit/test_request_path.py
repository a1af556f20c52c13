"""The request path of a distributed weight update, as patches/0001..0004 hook it into SGLang 0.5.23.

Checked against the installed wheel, in one process, without an engine: the request
types and their msgpack round trip, Engine / TokenizerManager / HTTP entry points, the
scheduler's dispatcher entry and handler (session check, receive once, apply per runner,
final TP barrier, the reserved load_format of the tensor path), the TP worker and model
runner hooks. ``sglang.srt.weight_sync.engine_update`` is imported inside the tests only,
and its functions are replaced by fakes where a hook calls them: this file checks the
wiring, not the update itself.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import json
import os
import tempfile
from types import SimpleNamespace
from typing import List

import msgspec
import pytest
import torch

import sglang.srt.managers.io_struct as io

SESSION_MESSAGE = "update_weights_distributed must run between begin_weight_update() and end_weight_update()"
FIGURES = {
    "bytes_received": [4, 6],
    "lower_bound_bytes": [4, 6],
    "peak_staging_bytes": [2, 3],
}
# where each engine rank's seconds went (weight_sync.phase_timing), in the reply beside the figures
PHASES = {"apply": [0.5, 0.25], "rounds": [1.0, 2.0]}
REPLY = {**FIGURES, "phases": PHASES}
NO_FIGURES = {
    "bytes_received": [],
    "lower_bound_bytes": [],
    "peak_staging_bytes": [],
    "phases": {},
}


@functools.lru_cache(maxsize=None)
def channel_dir() -> str:
    """A real (empty) channel directory, made on first use and removed at exit: the tokenizer
    manager validates the channel before any scheduler sees it."""
    path = tempfile.mkdtemp(prefix="sglang-weights-")
    atexit.register(os.rmdir, path)
    return path


def _request(**kw) -> io.UpdateWeightsDistributedReqInput:
    return io.UpdateWeightsDistributedReqInput(
        **{"update_id": "u", "channel": channel_dir(), **kw}
    )


# ---------------------------------------------------------------- io_struct (patch 0001)


def test_request_types_are_registered_direct_base_req_subclasses():
    for cls in (
        io.UpdateWeightsDistributedReqInput,
        io.UpdateWeightsDistributedReqOutput,
    ):
        assert cls.__module__ == io.__name__
        assert io.BaseReq in cls.__bases__, (
            f"{cls.__name__} must subclass BaseReq directly"
        )
        assert cls in io._struct_types, (
            f"{cls.__name__} is missing from the msgpack decoder's union"
        )
    # upstream's type for the NCCL broadcast path is a different struct with a different wire tag
    assert (
        io.UpdateWeightsDistributedReqInput
        is not io.UpdateWeightsFromDistributedReqInput
    )


def test_request_defaults():
    req = _request()
    assert (req.update_id, req.channel, req.timeout_s, req.bucket_bytes) == (
        "u",
        channel_dir(),
        120.0,
        None,
    )
    assert req.flush_cache is True and req.abort_all_requests is False
    assert req.weight_version is None and req.selector == "all"
    assert (
        req.torch_empty_cache is False
    )  # read by the scheduler's flush_cache_after_weight_update
    with pytest.raises(TypeError):
        io.UpdateWeightsDistributedReqInput(
            channel=channel_dir()
        )  # update_id is required


def test_every_default_timeout_is_the_protocols():
    """The hooks spell the default bound as a literal (upstream files import nothing of ours
    at module level); it must be protocol.DEFAULT_TIMEOUT_S everywhere."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.entrypoints.http_server_engine import HttpServerEngineAdapter
    from sglang.srt.weight_sync.protocol import DEFAULT_TIMEOUT_S

    assert _request().timeout_s == DEFAULT_TIMEOUT_S
    for method in (
        Engine.update_weights_distributed,
        HttpServerEngineAdapter.update_weights_distributed,
    ):
        assert (
            inspect.signature(method).parameters["timeout_s"].default
            == DEFAULT_TIMEOUT_S
        ), method


def test_request_round_trips_through_scheduler_ipc_msgpack():
    for req in (
        _request(),
        _request(
            timeout_s=5.5,
            bucket_bytes=1 << 20,
            flush_cache=False,
            abort_all_requests=True,
            weight_version="v7",
            selector="target",
            torch_empty_cache=True,
            rid="r1",
        ),
    ):
        data = io.msgpack_encode(req)  # what sock_send puts on the ZMQ socket
        back = io.msgpack_decode(data)  # what sock_recv returns (io._msgpack_decoder)
        assert type(back) is io.UpdateWeightsDistributedReqInput
        assert back == req


def test_output_constructs_and_round_trips():
    for out in (
        io.UpdateWeightsDistributedReqOutput(success=True, message="Success", **REPLY),
        io.UpdateWeightsDistributedReqOutput(success=False, message="refused"),
    ):
        back = io.msgpack_decode(io.msgpack_encode(out))
        assert type(back) is io.UpdateWeightsDistributedReqOutput and back == out


def test_selector_is_validated_on_decode():
    bad = io.msgpack_encode(_request()).replace(b"all", b"xyz")
    with pytest.raises(msgspec.ValidationError):
        io.msgpack_decode(bad)


# ---------------------------------------------------------------- Engine, TokenizerManager (patch 0002)


def test_engine_method_builds_request_and_returns_tokenizer_result():
    from sglang.srt.entrypoints.engine import Engine

    params = list(inspect.signature(Engine.update_weights_distributed).parameters)
    assert params == [
        "self",
        "update_id",
        "channel",
        "timeout_s",
        "bucket_bytes",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "selector",
    ]
    seen = []

    class FakeTokenizerManager:
        async def update_weights_distributed(self, obj, request):
            seen.append((obj, request))
            return {"success": True, "message": "Success", **REPLY}

    engine = SimpleNamespace(
        loop=asyncio.new_event_loop(), tokenizer_manager=FakeTokenizerManager()
    )
    try:
        result = Engine.update_weights_distributed(
            engine,
            "u1",
            channel_dir(),
            timeout_s=9.0,
            bucket_bytes=64,
            flush_cache=False,
            weight_version="v2",
            selector="target",
        )
    finally:
        engine.loop.close()
    assert result == {"success": True, "message": "Success", **REPLY}
    ((obj, request),) = seen
    assert request is None
    assert obj == io.UpdateWeightsDistributedReqInput(
        update_id="u1",
        channel=channel_dir(),
        timeout_s=9.0,
        bucket_bytes=64,
        flush_cache=False,
        weight_version="v2",
        selector="target",
    )


def test_tokenizer_communicator_is_declared():
    from sglang.srt.managers import tokenizer_control_mixin as tcm

    specs = {spec[0]: spec for spec in tcm._COMMUNICATOR_SPECS}
    assert specs["update_weights_distributed"] == (
        "update_weights_distributed",
        io.UpdateWeightsDistributedReqOutput,
    )


class _FakeTokenizerManager:
    """Just what TokenizerControlMixin.update_weights_distributed touches."""

    def __init__(self, replies, paused=False):
        from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin

        self._mixin = TokenizerControlMixin
        self.replies, self.is_pause, self.events = replies, paused, []
        self.is_pause_cond = asyncio.Condition()
        self.mm_processor = SimpleNamespace(
            clear_preprocess_cache=lambda: self.events.append("clear_mm")
        )
        manager = self

        class _Lock:
            @property
            def writer_lock(self):
                class _Writer:
                    async def __aenter__(self_inner):
                        manager.events.append("writer_lock")

                    async def __aexit__(self_inner, *exc):
                        manager.events.append("writer_unlock")

                return _Writer()

        self.model_update_lock = _Lock()

    def auto_create_handle_loop(self):
        pass

    def abort_request(self, abort_all=False):
        self.events.append(("abort", abort_all))

    async def update_weights_distributed_communicator(self, obj):
        self.events.append(("send", obj))
        return self.replies

    def _update_weight_version_if_provided(self, version):
        self.events.append(("version", version))

    def _weight_update_session_call(self, communicator, obj):
        return self._mixin._weight_update_session_call(self, communicator, obj)

    def call(self, obj):
        return asyncio.run(self._mixin.update_weights_distributed(self, obj))


@pytest.fixture
def single_dp(monkeypatch):
    from sglang.srt.managers import tokenizer_control_mixin as tcm

    monkeypatch.setattr(
        tcm, "get_parallel", lambda: SimpleNamespace(dp_size=1, num_dp_ranks=1)
    )


def test_tokenizer_method_takes_writer_lock_and_applies_version(single_dp):
    ok = [
        io.UpdateWeightsDistributedReqOutput(success=True, message="Success", **REPLY)
    ]
    tm = _FakeTokenizerManager(ok)
    req = _request(weight_version="v3", abort_all_requests=True)
    # upstream's message and version note; the figures in their own fields
    assert tm.call(req) == {
        "success": True,
        "message": "Success Weight version updated to v3.",
        "mixed": False,
        **REPLY,
    }
    assert tm.events == [
        ("abort", True),
        "writer_lock",
        ("send", req),
        "writer_unlock",
        "clear_mm",
        ("version", "v3"),
    ]


def test_tokenizer_method_when_paused_skips_writer_lock(single_dp):
    tm = _FakeTokenizerManager(
        [io.UpdateWeightsDistributedReqOutput(success=True, message="Success")],
        paused=True,
    )
    req = _request(flush_cache=False)
    assert tm.call(req) == {
        "success": True,
        "message": "Success",
        "mixed": False,
        **NO_FIGURES,
    }
    assert tm.events == [("send", req)]


def test_reply_says_mixed_as_a_field(single_dp):
    mixed = [
        io.UpdateWeightsDistributedReqOutput(
            success=False, message="FAILED after writes began", mixed=True
        )
    ]
    reply = _FakeTokenizerManager(mixed).call(_request())
    assert reply["mixed"] is True and reply["success"] is False


def test_tokenizer_method_failure_keeps_version(single_dp):
    bad = [io.UpdateWeightsDistributedReqOutput(success=False, message="refused")]
    tm = _FakeTokenizerManager(bad)
    assert tm.call(_request(weight_version="v3")) == {
        "success": False,
        "message": "refused",
        "mixed": False,
        **NO_FIGURES,
    }
    assert not [
        e
        for e in tm.events
        if e == "clear_mm" or (isinstance(e, tuple) and e[0] == "version")
    ]


@pytest.mark.parametrize(
    "field,value,text",
    [
        ("timeout_s", -1, "timeout_s=-1: must be a number of seconds in (0, 3600]"),
        ("timeout_s", 2_147_484, "timeout_s=2147484"),
        ("timeout_s", "soon", "timeout_s='soon'"),
        ("bucket_bytes", 1, "bucket_bytes=1: must be None"),
        ("bucket_bytes", -1, "bucket_bytes=-1"),
        ("update_id", "", "update_id='': must be a non-empty string"),
        (
            "channel",
            "/nonexistent/sglang-weights-x",
            "channel '/nonexistent/sglang-weights-x' does not exist",
        ),
    ],
)
def test_tokenizer_method_refuses_bad_fields_before_any_scheduler(
    single_dp, field, value, text
):
    tm = _FakeTokenizerManager([])
    reply = tm.call(_request(**{field: value}))
    assert not reply["success"] and text in reply["message"], reply
    assert {k: reply[k] for k in NO_FIGURES} == NO_FIGURES
    assert tm.events == []  # nothing aborted, locked or sent


def test_tokenizer_method_rejects_dp_replicas(monkeypatch):
    from sglang.srt.managers import tokenizer_control_mixin as tcm

    monkeypatch.setattr(
        tcm, "get_parallel", lambda: SimpleNamespace(dp_size=2, num_dp_ranks=2)
    )
    with pytest.raises(AssertionError, match="data-parallel"):
        _FakeTokenizerManager([]).call(_request())


# ---------------------------------------------------------------- scheduler, TP worker, model runner (patch 0003)


def test_scheduler_dispatcher_registers_the_request():
    import sglang.srt.managers.scheduler as scheduler

    source = inspect.getsource(scheduler.Scheduler.init_request_dispatcher)
    compact = "".join(source.split())
    assert (
        "(UpdateWeightsDistributedReqInput,self.weight_updater.update_weights_distributed,)"
        in compact
    )
    assert (
        scheduler.UpdateWeightsDistributedReqInput
        is io.UpdateWeightsDistributedReqInput
    )


class _Runner:
    def __init__(self, role, log, result=(True, "Success")):
        self.role, self.log, self.result = role, log, result
        self.weight_updater = self

    def update_weights_distributed(self, received, recv_req):
        self.log.append((self.role, received, recv_req))
        return self.result

    def begin_weight_update(self):
        self.log.append((self.role, "begin"))

    def end_weight_update(self, *, run_post_load):
        self.log.append((self.role, "end", run_post_load))


@pytest.fixture
def manager(monkeypatch):
    """A real SchedulerWeightUpdaterManager with fake workers, TP group and barrier."""
    from sglang.srt.managers.scheduler_components import weight_updater as swu

    log: List = []
    monkeypatch.setattr(
        swu,
        "get_parallel",
        lambda: SimpleNamespace(tp_group=SimpleNamespace(cpu_group="tp_cpu")),
    )
    monkeypatch.setattr(
        torch.distributed, "barrier", lambda group=None: log.append(("barrier", group))
    )

    from sglang.srt.weight_sync import engine_update
    from sglang.srt.weight_sync.engine_update import ReceivedShards

    # the handler's closing barrier, bounded (engine_update.end_of_update; tested below)
    monkeypatch.setattr(
        engine_update,
        "end_of_update",
        lambda received, req, success, message: (
            log.append(("end_of_update", success)) or (success, message)
        ),
    )

    class TpWorker:
        received = ReceivedShards(
            None, None, figures=dict(FIGURES), phases=dict(PHASES)
        )

        def weight_update_runners(self):
            return [("target", _Runner("target", log))]

        def receive_weight_shards(self, recv_req):
            log.append(("receive", recv_req))
            return self.received

        def deserialize_own_rank(self, payloads):
            log.append(("deserialize", payloads))
            return {
                "update_id": "from-tensor",
                "channel": channel_dir(),
                "timeout_s": 3.0,
                "bucket_bytes": 128,
            }

    class DraftWorker:
        def weight_update_runners(self):
            return [("draft", _Runner("draft", log))]

    scheduler = SimpleNamespace(
        record_weight_version_change=lambda new_version: log.append(
            ("version", new_version)
        )
    )

    def flush_cache(empty_cache=False):
        log.append(("flush", empty_cache))
        return True

    m = swu.SchedulerWeightUpdaterManager(
        tp_worker=TpWorker(),
        draft_worker=DraftWorker(),
        memory_saver_adapter=None,
        flush_cache=flush_cache,
        is_fully_idle=lambda **kw: True,
        scheduler=scheduler,
    )
    m._session = swu._WeightUpdateSession(selector="all")
    return m, log


def test_scheduler_handler_requires_session(manager):
    m, log = manager
    m._session = None
    out = m.update_weights_distributed(_request())
    assert type(out) is io.UpdateWeightsDistributedReqOutput
    assert (out.success, out.message) == (False, SESSION_MESSAGE)
    assert log == []  # rejected on every rank before any receive or barrier


def test_scheduler_handler_receives_once_and_applies_to_each_runner(manager):
    m, log = manager
    req = _request(weight_version="v9", torch_empty_cache=True)
    out = m.update_weights_distributed(req)
    assert type(out) is io.UpdateWeightsDistributedReqOutput and (
        out.success,
        out.message,
    ) == (True, "Success")
    assert (out.bytes_received, out.lower_bound_bytes, out.peak_staging_bytes) == tuple(
        FIGURES.values()
    )
    assert out.phases == PHASES
    received = m.tp_worker.received
    assert log == [
        ("receive", req),
        ("target", received, req),
        ("draft", received, req),
        ("version", "v9"),
        ("flush", True),
        ("end_of_update", True),
    ]
    # parameters were copied in place, not through model.load_weights: end_weight_update() still post-loads
    assert m._session.loaded_weights is False and m._session.written_in_place


@pytest.mark.parametrize("load", ["before", "after"])
def test_a_session_that_also_loaded_still_post_loads_what_was_copied_in_place(
    manager, load
):
    """A session that ran an ordinary load (``model.load_weights``, which post-processes
    only the layers it loaded) before or after a distributed update still ends with
    ``post_load_weights``: the parameters the update copied in place need it (MLA's
    ``w_kc``/``w_vc`` would stay those of the old weights). A session of loads alone does not."""
    from sglang.srt.managers.scheduler_components import weight_updater as swu

    m, log = manager

    def loaded():  # what upstream's tensor and distributed loads record
        m._session = msgspec.structs.replace(m._session, loaded_weights=True)

    if load == "before":
        loaded()
    assert m.update_weights_distributed(_request()).success
    if load == "after":
        loaded()
    m.end_weight_update(io.EndWeightUpdateReqInput())
    assert [e for e in log if e[1:2] == ("end",)] == [
        ("target", "end", True),
        ("draft", "end", True),
    ]
    log.clear()
    m._session = swu._WeightUpdateSession(selector="all", loaded_weights=True)
    m.end_weight_update(io.EndWeightUpdateReqInput())
    assert [e for e in log if e[1:2] == ("end",)] == [
        ("target", "end", False),
        ("draft", "end", False),
    ]


def test_scheduler_handler_selector_and_no_flush(manager):
    m, log = manager
    m.update_weights_distributed(_request(selector="target", flush_cache=False))
    assert [e[0] for e in log] == ["receive", "target", "version", "end_of_update"]


def test_scheduler_handler_failure_stops_and_still_barriers(manager):
    m, log = manager
    m.tp_worker.weight_update_runners = lambda: [
        ("target", _Runner("target", log, (False, "refused: rank 1")))
    ]
    out = m.update_weights_distributed(_request(weight_version="v9"))
    assert (out.success, out.message) == (False, "refused: rank 1")
    assert log[-1] == ("end_of_update", False)
    assert [e[0] for e in log] == [
        "receive",
        "target",
        "end_of_update",
    ]  # no draft, no version, no flush


@pytest.mark.parametrize(
    "before", [(True, "Success"), (False, "refused: engine rank 1: no payload")]
)
def test_closing_barrier_is_bounded_and_names_the_missing_rank(monkeypatch, before):
    from sglang.srt.weight_sync import engine_update
    from sglang.srt.weight_sync.control_plane import PeerLost

    calls = []

    class Control:  # the engine's TP control group: its barrier never completes
        lost = None

        def barrier(self, timeout_s, phase):
            calls.append((timeout_s, phase))
            raise PeerLost(
                f"{phase}: ranks [1] never reached it; Rank 1 failed to pass monitoredBarrier (within "
                f"{timeout_s:g}s)"
            )

    sync = engine_update.EngineWeightSync(0)
    sync._control = Control()
    received = engine_update.ReceivedShards(sync, None)
    success, message = engine_update.end_of_update(
        received, _request(timeout_s=5.0), *before
    )
    assert calls == [
        (5.0 + engine_update.GRACE_S, "engine rank 0: at the end of the update")
    ]
    assert (
        success is False
        and "ranks [1] never reached it" in message
        and f"within {5 + engine_update.GRACE_S:g}s" in message
    )
    assert message.startswith(
        "refused: engine rank 1: no payload; "
        if not before[0]
        else "distributed weight update failed: engine rank 0: at the end of the update"
    )
    sync._control = SimpleNamespace(barrier=lambda timeout_s, phase: None, lost=None)
    assert engine_update.end_of_update(received, _request(), *before) == before


def test_tensor_path_reserved_load_format_routes_to_the_distributed_handler(manager):
    from sglang.srt.weight_sync import engine_update

    m, log = manager
    payloads = [b"rank0", b"rank1"]
    req = io.UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=payloads,
        load_format=engine_update.DISTRIBUTED_LOAD_FORMAT,
        flush_cache=False,
        weight_version="v4",
        selector="target",
    )
    out = m.update_weights_from_tensor(req)
    # upstream's reply struct and text: the figures stay in the log
    assert type(out) is io.UpdateWeightsFromTensorReqOutput and (
        out.success,
        out.message,
    ) == (True, "Success")
    assert log[0] == ("deserialize", payloads)
    kind, converted = log[1]
    assert kind == "receive" and type(converted) is io.UpdateWeightsDistributedReqInput
    assert (
        converted.update_id,
        converted.channel,
        converted.timeout_s,
        converted.bucket_bytes,
    ) == ("from-tensor", channel_dir(), 3.0, 128)
    assert (converted.flush_cache, converted.weight_version, converted.selector) == (
        False,
        "v4",
        "target",
    )
    assert [e[0] for e in log[2:]] == ["target", "version", "end_of_update"]


def test_tensor_path_reserved_load_format_still_requires_session(manager):
    from sglang.srt.weight_sync import engine_update

    m, log = manager
    m._session = None
    out = m.update_weights_from_tensor(
        io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[b"x"],
            load_format=engine_update.DISTRIBUTED_LOAD_FORMAT,
        )
    )
    assert type(out) is io.UpdateWeightsFromTensorReqOutput and not out.success
    assert "begin_weight_update()" in out.message and log == []


def test_tp_worker_hook_delegates_to_receive_shards(monkeypatch):
    from sglang.srt.managers.tp_worker import BaseTpWorker
    from sglang.srt.weight_sync import engine_update

    req, marker, worker = _request(), object(), object()
    monkeypatch.setattr(
        engine_update,
        "receive_shards",
        lambda r, owner: marker if r is req and owner is worker else None,
    )
    assert BaseTpWorker.receive_weight_shards(worker, req) is marker


def _model_weight_updater(model, model_config="cfg"):
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        WeightUpdater,
    )

    return WeightUpdater(
        tp_rank=0,
        device="cpu",
        gpu_id=0,
        model_config=model_config,
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=None,
        recapture_cuda_graph=None,
        get_model_runner=None,
    )


def test_model_runner_hook_delegates_to_apply_shards(monkeypatch):
    from sglang.srt.model_executor.model_runner_components import weight_updater as mwu
    from sglang.srt.weight_sync import engine_update

    calls = []
    monkeypatch.setattr(
        mwu, "get_model", lambda: SimpleNamespace(weight_cache_mode="off")
    )
    monkeypatch.setattr(
        mwu, "_unsupported_derived_weight_cache_error", lambda model: None
    )
    monkeypatch.setattr(
        engine_update, "apply_shards", lambda *a: calls.append(a) or (True, "applied")
    )
    model, received, req = torch.nn.Linear(2, 2), object(), _request()
    assert _model_weight_updater(model).update_weights_distributed(received, req) == (
        True,
        "applied",
    )
    assert calls == [(model, "cfg", received, req)]


def test_model_runner_hook_refuses_derived_weight_caches_and_weight_cache(monkeypatch):
    from sglang.srt.model_executor.model_runner_components import weight_updater as mwu
    from sglang.srt.weight_sync import engine_update

    monkeypatch.setattr(
        engine_update,
        "apply_shards",
        lambda *a: pytest.fail("apply_shards must not run"),
    )
    updater = _model_weight_updater(torch.nn.Linear(2, 2))

    monkeypatch.setattr(
        mwu,
        "_unsupported_derived_weight_cache_error",
        lambda model: "derived cache active",
    )
    assert updater.update_weights_distributed(object(), _request()) == (
        False,
        "derived cache active",
    )

    monkeypatch.setattr(
        mwu, "_unsupported_derived_weight_cache_error", lambda model: None
    )
    monkeypatch.setattr(
        mwu, "get_model", lambda: SimpleNamespace(weight_cache_mode="daemon")
    )
    success, message = updater.update_weights_distributed(object(), _request())
    assert (
        not success
        and "update_weights_distributed" in message
        and "--weight-cache-mode daemon" in message
    )


# ---------------------------------------------------------------- implicit sessions (patches 0006, 0007)


def test_engine_base_no_longer_requires_session_methods():
    """verl 0.9.1's AsyncHttpServerAdapter subclasses EngineBase without them: it must construct."""
    from sglang.srt.entrypoints.EngineBase import EngineBase

    assert (
        not {"begin_weight_update", "end_weight_update"}
        & EngineBase.__abstractmethods__
    )
    assert {
        "generate",
        "update_weights_from_tensor",
        "flush_cache",
    } <= EngineBase.__abstractmethods__


def test_scheduler_dispatcher_wraps_session_updates():
    import sglang.srt.managers.scheduler as scheduler

    source = "".join(
        inspect.getsource(scheduler.Scheduler.init_request_dispatcher).split()
    )
    assert source.endswith(
        "self._request_dispatcher=with_implicit_sessions(self._request_dispatcher,self.weight_updater)"
    )


def _dispatcher(m, log):
    from sglang.srt.weight_sync.sessions import with_implicit_sessions
    from sglang.utils import TypeBasedDispatcher

    inner = TypeBasedDispatcher(
        [
            (io.UpdateWeightsDistributedReqInput, m.update_weights_distributed),
            (io.UpdateWeightsFromTensorReqInput, m.update_weights_from_tensor),
            (
                io.FlushCacheReqInput,
                lambda req: log.append("flush_handler") or "flushed",
            ),
        ]
    )
    return with_implicit_sessions(inner, m)


def test_release_of_memory_drops_the_data_group_after_sglangs_release(
    manager, monkeypatch
):
    """0.5.23: the memory saver's release, through the scheduler's dispatcher, runs SGLang's
    own release, then drops the weight sync's data group (NCCL's buffers are not the
    saver's); an engine that never updated has none to drop."""
    m, log = manager
    monkeypatch.setattr(
        type(m),
        "release_memory_occupation",
        lambda self, req: log.append(("release", req)) or "released",
    )
    req = io.ReleaseMemoryOccupationReqInput()
    assert _dispatcher(m, log)(req) == "released"  # no weight sync yet: nothing to drop
    assert log == [("release", req)]
    m.tp_worker._weight_sync = SimpleNamespace(
        drop_data_group=lambda: log.append(("drop_data_group",))
    )
    assert _dispatcher(m, log)(req) == "released"
    assert log[1:] == [("release", req), ("drop_data_group",)]


def test_update_without_session_runs_in_a_one_shot_session(manager):
    m, log = manager
    m._session = None
    req = _request(selector="target", flush_cache=False)
    out = _dispatcher(m, log)(req)
    assert (out.success, out.message) == (True, "Success")
    received = m.tp_worker.received
    # SGLang's own begin, the update, SGLang's own end (post_load: nothing went through load_weights)
    assert log == [
        ("target", "begin"),
        ("barrier", "tp_cpu"),
        ("receive", req),
        ("target", received, req),
        ("version", None),
        ("end_of_update", True),
        ("target", "end", True),
        ("barrier", "tp_cpu"),
    ]
    assert m._session is None


def test_tensor_path_without_session_runs_in_a_one_shot_session(manager):
    from sglang.srt.weight_sync import engine_update

    m, log = manager
    m._session = None
    out = _dispatcher(m, log)(
        io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[b"x"],
            load_format=engine_update.DISTRIBUTED_LOAD_FORMAT,
            flush_cache=False,
        )
    )
    assert type(out) is io.UpdateWeightsFromTensorReqOutput and (
        out.success,
        out.message,
    ) == (True, "Success")
    assert [e[1] for e in log if e[0] == "target"][:1] == ["begin"] and log[-2][1:] == (
        "end",
        True,
    )
    assert m._session is None


def test_update_inside_an_explicit_session_leaves_it_open(manager):
    m, log = manager
    req = _request(flush_cache=False)
    out = _dispatcher(m, log)(req)
    assert out.success and not [
        e for e in log if e[-1] in ("begin",) or (len(e) == 3 and e[1] == "end")
    ]
    assert m._session is not None


def test_one_shot_session_closes_after_a_refused_update(manager):
    m, log = manager
    m._session = None
    m.tp_worker.weight_update_runners = lambda: [
        ("target", _Runner("target", log, (False, "refused: rank 1")))
    ]
    out = _dispatcher(m, log)(_request())
    assert (out.success, out.message) == (False, "refused: rank 1")
    assert log[-3:] == [
        ("target", "end", True),
        ("draft", "end", True),
        ("barrier", "tp_cpu"),
    ]
    assert m._session is None


def test_other_requests_pass_through(manager):
    m, log = manager
    assert _dispatcher(m, log)(io.FlushCacheReqInput()) == "flushed" and log == [
        "flush_handler"
    ]


# ---------------------------------------------------------------- HTTP (patch 0004)


def test_http_route_is_registered_with_admin_optional_auth():
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.utils.auth import AuthLevel

    routes = [
        r
        for r in app.routes
        if getattr(r, "path", None) == "/update_weights_distributed"
    ]
    assert len(routes) == 1 and routes[0].methods == {"POST"}
    assert routes[0].endpoint._auth_level == AuthLevel.ADMIN_OPTIONAL


@pytest.mark.parametrize("success,status", [(True, 200), (False, 400)])
def test_http_route_parses_body_and_maps_status(monkeypatch, success, status):
    from fastapi.testclient import TestClient

    import sglang.srt.entrypoints.http_server as http_server

    seen = []

    class FakeTokenizerManager:
        async def update_weights_distributed(self, obj, request):
            seen.append(obj)
            return {"success": success, "message": "msg", **REPLY}

    monkeypatch.setattr(
        http_server,
        "_global_state",
        SimpleNamespace(
            tokenizer_manager=FakeTokenizerManager(),
            template_manager=None,
            scheduler_info={},
        ),
    )
    body = {
        "update_id": "u2",
        "channel": channel_dir(),
        "timeout_s": 7.0,
        "bucket_bytes": 4096,
        "selector": "target",
    }
    response = TestClient(http_server.app).post(
        "/update_weights_distributed", json=body
    )
    assert response.status_code == status, response.text
    assert response.json() == {"success": success, "message": "msg", **REPLY}
    assert seen == [
        io.UpdateWeightsDistributedReqInput(
            update_id="u2",
            channel=channel_dir(),
            timeout_s=7.0,
            bucket_bytes=4096,
            selector="target",
        )
    ]


@pytest.mark.parametrize(
    "body",
    [
        {"channel": "c"},  # update_id missing
        {"update_id": "u"},  # channel missing
        {"update_id": 7, "channel": "c"},
        {"update_id": "u", "channel": "c", "timeout_s": "soon"},
        {"update_id": "u", "channel": "c", "bucket_bytes": "big"},
        {"update_id": "u", "channel": ["c"]},
    ],
)
def test_http_route_rejects_malformed_bodies_with_400(monkeypatch, body):
    """SGLang's server answers a body its schema rejects with 400 (its
    RequestValidationError handler replaces FastAPI's 422), as docs/usage.md says."""
    from fastapi.testclient import TestClient

    import sglang.srt.entrypoints.http_server as http_server

    class NeverCalled:
        async def update_weights_distributed(self, obj, request):
            pytest.fail(f"a malformed body reached the tokenizer manager: {obj}")

    monkeypatch.setattr(
        http_server,
        "_global_state",
        SimpleNamespace(
            tokenizer_manager=NeverCalled(), template_manager=None, scheduler_info={}
        ),
    )
    response = TestClient(http_server.app).post(
        "/update_weights_distributed", json=body
    )
    assert response.status_code == 400, (response.status_code, response.text)


@pytest.mark.parametrize(
    "channel,text",
    [
        ("{channel}\x00x", "holds a NUL byte"),  # filled in below
        ("/tmp/sglang-weights-\udcff", "JSON decode error"),
    ],
)
def test_http_route_refuses_unusable_channel_paths_with_400(
    monkeypatch, single_dp, channel, text
):
    """A channel path with a NUL or undecodable bytes is answered 400 naming the channel
    (the tokenizer manager's own check), never 500, and reaches no scheduler."""
    channel = channel.format(channel=channel_dir())
    from fastapi.testclient import TestClient

    import sglang.srt.entrypoints.http_server as http_server

    tm = _FakeTokenizerManager([])
    tm.update_weights_distributed = lambda obj, request: (
        tm._mixin.update_weights_distributed(tm, obj, request)
    )
    monkeypatch.setattr(
        http_server,
        "_global_state",
        SimpleNamespace(tokenizer_manager=tm, template_manager=None, scheduler_info={}),
    )
    response = TestClient(http_server.app).post(
        "/update_weights_distributed",
        # ASCII JSON: the path's NUL or lone surrogate travels as a \u escape
        content=json.dumps({"update_id": "u", "channel": channel}).encode(),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, (response.status_code, response.text)
    message = str(response.json()["message"])
    if text == "JSON decode error":  # the server's JSON parser refuses the body itself
        assert "invalid high surrogate" in message, message
    else:
        assert f"channel {channel!r}" in message and text in message, message
    assert tm.events == []  # nothing aborted, locked or sent


def test_http_adapter_posts_the_engine_arguments(monkeypatch):
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.entrypoints.http_server_engine import HttpServerEngineAdapter

    assert not getattr(
        HttpServerEngineAdapter, "__abstractmethods__", None
    )  # still instantiable

    def names_and_defaults(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    assert names_and_defaults(
        HttpServerEngineAdapter.update_weights_distributed
    ) == names_and_defaults(Engine.update_weights_distributed)
    import sglang.srt.entrypoints.http_server_engine as module

    posted, replies = [], []

    class Response:
        def __init__(self, status, body):
            self.status_code, self._body = status, body

        def raise_for_status(self):
            if self.status_code >= 400:
                raise RuntimeError(f"HTTP {self.status_code}")

        def json(self):
            return self._body

    def post(url, json=None, verify=None):
        posted.append((url, json))
        return replies.pop(0)

    monkeypatch.setattr(module.requests, "post", post)
    monkeypatch.setattr(module, "ssl_verify_of", lambda server_args: True)
    adapter = object.__new__(HttpServerEngineAdapter)
    adapter.server_args = type("Args", (), {"url": lambda self: "http://host:1"})()
    replies.append(Response(200, {"success": True, "message": "ok"}))
    assert adapter.update_weights_distributed(
        "u3", channel_dir(), weight_version="v1"
    ) == {
        "success": True,
        "message": "ok",
    }
    ((url, payload),) = posted
    assert url == "http://host:1/update_weights_distributed"
    # a refused update (400) comes back with the server's message, which names tensor and rank
    replies.append(Response(400, {"success": False, "message": "unknown tensor 'x'"}))
    assert adapter.update_weights_distributed("u4", channel_dir()) == {
        "success": False,
        "message": "unknown tensor 'x'",
    }
    replies.append(Response(500, {}))
    with pytest.raises(RuntimeError, match="HTTP 500"):
        adapter.update_weights_distributed("u5", channel_dir())
    # the JSON body names every field of the request the Engine method builds
    json.dumps(payload)
    assert io.UpdateWeightsDistributedReqInput(
        **payload
    ) == io.UpdateWeightsDistributedReqInput(
        update_id="u3", channel=channel_dir(), weight_version="v1"
    )


# ---------------------------------------------------------------- weights released by the memory saver


def test_update_while_weights_are_released_is_refused_before_anything(manager):
    """``release_memory_occupation(tags=["weights"])`` records the tag in the manager's
    ``offload_tags`` on every TP rank: a distributed update is refused there, with no
    session, payload or barrier, and runs again once the weights are resumed."""
    from sglang.srt.weight_sync import engine_update
    from sglang.srt.weight_sync.protocol import REFUSED, WEIGHTS_RELEASED

    m, log = manager
    m._session = None
    m.offload_tags.add("weights")
    dispatch = _dispatcher(m, log)
    out = dispatch(_request(flush_cache=False))
    assert type(out) is io.UpdateWeightsDistributedReqOutput
    assert (out.success, out.mixed) == (False, False)
    assert out.message == REFUSED + WEIGHTS_RELEASED
    assert "call resume_memory_occupation(tags=['weights']) first" in out.message
    out = dispatch(
        io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[b"x"],
            load_format=engine_update.DISTRIBUTED_LOAD_FORMAT,
        )
    )
    assert type(out) is io.UpdateWeightsFromTensorReqOutput and not out.success
    assert WEIGHTS_RELEASED in out.message
    assert log == [] and m._session is None  # nothing received, no session opened
    m.offload_tags.discard("weights")
    m.offload_tags.add("kv_cache")  # only released weights refuse
    assert dispatch(_request(flush_cache=False)).success
