"""What keeps the data plane and the engine's update safe on NVIDIA GPUs, shown on the CPU.

NCCL's own semantics (lazy communicators, the watchdog's abort) cannot run here; these
tests show what the code decides on each backend string (mocked ``dist.get_backend``),
that every control tensor is allocated on the group's device explicitly, that bounds
stay below the groups' timeouts, that the finite checks read one flag per update, and
that nothing of an update's payload outlives it. The multi-process parts (the data
plane's own group, its warm-up on every rank, point-to-point fan-out) are in
``test/distributed/test_data_group.py``.
"""

import gc
import weakref
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from ranks import one_rank_world

from sglang.srt.weight_sync import control_plane, executor
from sglang.srt.weight_sync.control_plane import (
    BoundTooLong,
    ControlGroup,
    check_bound,
    collective_device,
)
from sglang.srt.weight_sync.protocol import (
    DATA_GROUP_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    GRACE_S,
    MAX_TIMEOUT_S,
    answer_bound_s,
    trainer_bound_s,
)

BACKENDS = {
    # backend string: (control collectives' device, data plane's device)
    "gloo": ("cpu", "cpu"),
    "nccl": ("cuda:3", "cuda:3"),
    "cuda:nccl": ("cuda:3", "cuda:3"),
    "cpu:gloo,cuda:nccl": ("cpu", "cuda:3"),
    "NCCL": ("cuda:3", "cuda:3"),
}


@pytest.fixture
def backend(monkeypatch):
    """Set the backend string ``dist.get_backend`` reports; the current GPU is 3."""
    state = {}
    monkeypatch.setattr(dist, "get_backend", lambda group=None: state["backend"])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    return state


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_collective_and_data_devices_for_each_backend(backend, name):
    backend["backend"] = name
    control, data = BACKENDS[name]
    assert collective_device(None) == torch.device(control)
    assert executor.data_device(None) == torch.device(data)


class _Done:
    def wait(self, timeout=None):
        return True


def test_every_control_collective_allocates_on_the_group_device(monkeypatch):
    """Run every ``ControlGroup`` call under a default device of ``meta``: a control tensor
    allocated without naming the group's device would land there and be seen by the fake
    collectives (and could not be read back)."""
    seen = []

    def record(name, *tensors):
        for t in tensors:
            seen.append((name, t.device))

    def all_reduce(t, op=None, group=None, async_op=False):
        record("all_reduce", t)
        return _Done()

    def all_gather_into_tensor(out, t, group=None, async_op=False):
        record("all_gather_into_tensor", out, t)
        out.copy_(t.repeat(out.numel() // t.numel()))
        return _Done()

    def all_gather(outs, t, group=None, async_op=False):
        record("all_gather", t, *outs)
        for o in outs:
            o.copy_(t)
        return _Done()

    def broadcast(t, src=0, group=None, async_op=False):
        record("broadcast", t)
        return _Done()

    def barrier(group=None, async_op=False, device_ids=None):
        seen.append(("barrier", device_ids))
        return _Done()

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    for name, fn in dict(
        all_reduce=all_reduce,
        all_gather_into_tensor=all_gather_into_tensor,
        all_gather=all_gather,
        broadcast=broadcast,
        barrier=barrier,
        monitored_barrier=lambda **kw: seen.append(("monitored_barrier", None)),
    ).items():
        monkeypatch.setattr(dist, name, fn)
    group = ControlGroup(None, "devices")
    assert group.device == torch.device("cpu")
    with torch.device("meta"):
        assert group.all_equal(7, 5.0, "p")
        assert group.any(True, 5.0, "p")
        group.agree_on_plan("a" * 64, 5.0, "p")
        assert group.all_gather_ints([1, 2], 5.0, "p") == [[1, 2], [1, 2]]
        # the fake all-reduce adds nothing from rank 1, so its length reads 0
        assert group.share_bytes(b"abc", 5.0, "p") == [b"abc", b""]
        assert group.share_problems(["bad"], 5.0, "p") == ["bad"]
        assert group.share_figures([4, 5], 5.0, "p") == [[4, 0], [5, 0]]
        assert group.broadcast_bytes(b"xy", 0, 8, 5.0, "p") == b"xy"
        assert group.broadcast_result((True, "ok"), 0, 5.0, "p") == (True, "ok")
        assert group.broadcast_object({"k": 1}, 0, 5.0, "p") == {"k": 1}
        group.barrier(None, "p")
        group.barrier(5.0, "p")
    devices = {d for name, d in seen if name not in ("barrier", "monitored_barrier")}
    assert devices == {torch.device("cpu")}, seen
    assert {n for n, _ in seen} >= {
        "all_reduce",
        "all_gather_into_tensor",
        "all_gather",
        "broadcast",
        "barrier",
        "monitored_barrier",
    }


def test_every_bound_stays_below_the_data_group_timeout():
    for timeout_s in (1.0, DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S):
        for bound in (
            timeout_s,
            timeout_s + GRACE_S,
            answer_bound_s(timeout_s),
            trainer_bound_s(timeout_s),
        ):
            assert bound < DATA_GROUP_TIMEOUT_S, (timeout_s, bound)
    assert trainer_bound_s(MAX_TIMEOUT_S) == 2 * MAX_TIMEOUT_S + GRACE_S


def test_the_groups_made_for_updates_have_timeouts_above_every_bound(monkeypatch):
    """Where the engine's data group and a weight-sync group's groups are made, their timeout
    is checked against the largest bound (``trainer_bound_s(MAX_TIMEOUT_S)``, itself above
    ``MAX_TIMEOUT_S + GRACE_S``): one at or below it is refused, naming the values, before
    any group or rendezvous."""
    from sglang.srt.weight_sync import engine_update
    from sglang.srt.weight_sync.control_plane import check_group_timeout
    from sglang.srt.weight_sync.remote import group as remote_group

    largest = trainer_bound_s(MAX_TIMEOUT_S)
    assert largest > MAX_TIMEOUT_S + GRACE_S
    assert check_group_timeout(DATA_GROUP_TIMEOUT_S, "data") == DATA_GROUP_TIMEOUT_S
    for short in (MAX_TIMEOUT_S + GRACE_S, largest):
        with pytest.raises(BoundTooLong) as e:
            check_group_timeout(short, "the data group")
        assert str(e.value).startswith(f"the data group: a group timeout of {short:g}s")
        assert f"bound an update waits with, {largest:g}s" in str(e.value)

    short = MAX_TIMEOUT_S + GRACE_S
    monkeypatch.setattr(
        executor.DataGroup,
        "over_ranks_of",
        lambda *a: pytest.fail("a data group was made with a short timeout"),
    )
    monkeypatch.setattr(engine_update, "DATA_GROUP_TIMEOUT_S", short)
    with pytest.raises(BoundTooLong, match="^engine rank 0: the data group: "):
        engine_update.EngineWeightSync(0).data_group(30.0, 0)
    monkeypatch.setattr(
        remote_group, "meet", lambda *a: pytest.fail("the ranks met for short groups")
    )
    monkeypatch.setattr(remote_group, "DATA_GROUP_TIMEOUT_S", short)
    with pytest.raises(
        BoundTooLong, match="^group 'g' rank 2: the groups of epoch 3: "
    ):
        remote_group.SyncGroup("g", 3, 4, "nccl", 2, None, 30.0)


def test_a_bound_past_an_nccl_group_timeout_is_refused(monkeypatch):
    monkeypatch.setattr(control_plane, "group_timeout_s", lambda group, device: 600.0)
    gpu = torch.device("cuda", 0)
    check_bound(None, 599.0, "a wait", gpu)
    with pytest.raises(BoundTooLong) as e:
        check_bound(None, 600.0, "a wait", gpu)
    assert "waits up to 600s" in str(e.value) and "timeout is 600s" in str(e.value)
    # gloo ends a wait past its timeout with an error of its own: bounded, not refused
    check_bound(None, 7230.0, "a wait", torch.device("cpu"))


def test_the_trainer_refuses_a_timeout_its_nccl_group_would_cut_short(monkeypatch):
    """Before any collective: the trainer waits up to 2 * timeout_s + GRACE_S while the
    engine applies the update, which an NCCL group of 600 s would abort."""
    from sglang.srt.weight_sync.trainer_flow import TrainerSync

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(control_plane, "group_timeout_s", lambda group, device: 600.0)
    monkeypatch.setattr(
        dist,
        "broadcast",
        lambda *a, **k: pytest.fail("a collective ran before the bound was checked"),
    )
    with pytest.raises(BoundTooLong) as e:
        TrainerSync().channel([0], None, timeout_s=300.0)
    assert str(e.value).startswith("timeout_s=300: trainer rank 0")
    bound = 2 * 300 + GRACE_S
    assert f"waits up to {bound:g}s" in str(e.value) and "timeout is 600s" in str(
        e.value
    )


def test_group_timeout_is_read_from_the_group():
    with one_rank_world(77):
        assert control_plane.group_timeout_s(None) == 77.0
        data = executor.DataGroup.over_ranks_of(None, DATA_GROUP_TIMEOUT_S, 0)
        assert data.group is not dist.group.WORLD
        assert control_plane.group_timeout_s(data.group) == DATA_GROUP_TIMEOUT_S


def test_the_weight_sync_group_is_never_split_from_a_bound_default_group(monkeypatch):
    """A trainer's default group bound to a device (``init_process_group(device_id=...)``)
    makes torch split every new NCCL group from its communicator, which holds none of the
    engines' ranks. Gloo cannot bind a GPU here, so the default group's ``bound_device_id``
    is set by hand and torch's choice of a parent (``_get_split_source``) is watched: a plain
    group made over it gets one, the weight-sync group's (``join_group``) is never asked."""
    from torch.distributed import distributed_c10d

    choose = distributed_c10d._get_split_source
    chosen = []

    def watched(pg):
        chosen.append(choose(pg))
        return chosen[-1]

    monkeypatch.setattr(distributed_c10d, "_get_split_source", watched)
    with one_rank_world():
        default = distributed_c10d._get_default_group()
        default.bound_device_id = torch.device("cuda", 0)
        try:
            store = dist.HashStore()
            control_plane.join_group(store, "data", 0, 1, "gloo", DATA_GROUP_TIMEOUT_S)
            assert chosen == [], "the weight-sync group's maker was offered a parent"
            # the same torch, without the guard, picks the default group's backend
            distributed_c10d._new_process_group_helper(
                1,
                0,
                [],
                distributed_c10d.Backend("gloo"),
                dist.PrefixStore("plain", store),
                group_name="plain",
                timeout=timedelta(seconds=60),
            )
            assert len(chosen) == 1 and chosen[0] is not None, chosen
            assert distributed_c10d._get_split_source is watched
        finally:
            default.bound_device_id = None


# ------------------------------------------------------------------ devices of delivered shards


def _local_copy_plan():
    from sglang.srt.weight_sync.box import Box
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

    src = {"w": MeshSpec.full((4, 3), torch.float32, [0]).describe("w")}
    target = ParamTarget(
        "p", (4, 3), torch.float32, (Piece("w", Box((0, 0), (4, 3)), (), (0, 0)),)
    )
    return plan(src, {0: [target]})


def test_a_shard_without_data_is_refused_naming_the_tensor_and_both_devices():
    p = _local_copy_plan()
    params = {"p": torch.zeros(4, 3)}
    problems = executor.check_inputs(
        p, 0, {"w": torch.empty(4, 3, device="meta")}, params, torch.device("cpu")
    )
    assert len(problems) == 1, problems
    assert "tensor 'w'" in problems[0] and "on meta" in problems[0]
    assert "moves tensors on cpu" in problems[0]
    problems = executor.check_inputs(
        p, 0, {"w": torch.ones(4, 3)}, {"p": torch.empty(4, 3, device="meta")}
    )
    assert problems and "parameter 'p' is on meta" in problems[0]
    with pytest.raises(executor.ExecutionError, match="tensor 'w'.*on meta"):
        executor.execute(p, 0, {"w": torch.empty(4, 3, device="meta")}, params)
    executor.execute(p, 0, {"w": torch.ones(4, 3)}, params)
    assert torch.equal(params["p"], torch.ones(4, 3))


def test_a_shard_found_fine_is_checked_again_once_it_changed():
    """``check_inputs`` remembers the shard objects it found fine (a kept segment hands
    the same ones every update), but a shard given new data in place is checked again."""
    p = _local_copy_plan()
    params = {"p": torch.zeros(4, 3)}
    w = torch.ones(4, 3)
    assert executor.check_inputs(p, 0, {"w": w}, params) == []
    assert executor.check_inputs(p, 0, {"w": w}, params) == []
    w.data = torch.ones(2, 3)  # the same object, other data and shape
    problems = executor.check_inputs(p, 0, {"w": w}, params)
    assert len(problems) == 1 and "has shape (2, 3), expected (4, 3)" in problems[0]
    assert executor.check_inputs(p, 0, {"w": torch.ones(2, 3)}, params) == problems
    assert executor.check_inputs(p, 0, {"w": torch.ones(4, 3)}, params) == []


def test_a_parameter_shorter_than_the_plans_indices_is_refused_before_any_write():
    """The pieces of a fused parameter are checked once per parameter, with the largest
    index they land at: a parameter with fewer experts than the plan writes is refused."""
    from sglang.srt.weight_sync.box import Box
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

    names = [f"e{i}" for i in range(3)]
    src = {n: MeshSpec.full((4, 3), torch.float32, [0]).describe(n) for n in names}
    pieces = tuple(
        Piece(n, Box((0, 0), (4, 3)), (i,), (0, 0)) for i, n in enumerate(names)
    )
    p = plan(src, {0: [ParamTarget("w", (3, 4, 3), torch.float32, pieces)]})
    shards = {n: torch.ones(4, 3) for n in names}
    assert executor.check_inputs(p, 0, shards, {"w": torch.zeros(3, 4, 3)}) == []
    short = torch.zeros(2, 4, 3)
    problems = executor.check_inputs(p, 0, shards, {"w": short})
    assert problems == [
        "rank 0: parameter 'w' has shape (2, 4, 3), plan expects (4, 3) after indices "
        "up to (2,)"
    ]
    assert torch.equal(short, torch.zeros(2, 4, 3))


# ------------------------------------------------------------------ one host sync per finite check


@pytest.fixture
def host_reads(monkeypatch):
    """Counts tensor -> Python bool conversions (a host sync each on a GPU)."""
    count = [0]
    original = torch.Tensor.__bool__

    def counting(self):
        count[0] += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", counting)
    return count


def test_nonfinite_tensors_reads_one_flag_unless_one_is_bad(host_reads):
    from sglang.srt.weight_sync.apply import nonfinite_tensors

    tensors = {f"expert{i}": torch.randn(4, 4) for i in range(64)}
    tensors["ids"] = torch.arange(3)
    assert nonfinite_tensors(tensors) == [] and host_reads[0] == 1
    tensors["expert7"][1, 2] = float("nan")
    tensors["expert40"][0, 0] = float("inf")
    assert nonfinite_tensors(tensors) == ["expert7", "expert40"]


def test_nonfinite_buffers_reads_one_flag_unless_one_is_bad(host_reads):
    from sglang.srt.weight_sync.apply import nonfinite_buffers
    from sglang.srt.weight_sync.box import Box
    from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

    targets = [
        ParamTarget(
            f"experts{i}.w13",
            (8, 4, 3),
            torch.float32,
            tuple(
                Piece(f"e{i}.{j}", Box((0, 0), (4, 3)), (j,), (0, 0)) for j in range(8)
            ),
        )
        for i in range(4)
    ]
    buffers = {t.name: torch.randn(8, 4, 3) for t in targets}
    assert nonfinite_buffers(targets, buffers) == [] and host_reads[0] == 1
    buffers["experts2.w13"][5, 3, 2] = float("nan")
    assert nonfinite_buffers(targets, buffers) == ["experts2.w13"]


# ------------------------------------------------------------------ nothing held after an update


def test_the_engine_drops_the_payload_before_it_replies():
    from sglang.srt.weight_sync import engine_update
    from sglang.srt.weight_sync.delivery import Payload

    shard = torch.randn(16, 16)
    alive = weakref.ref(shard)
    sync = engine_update.EngineWeightSync(0)
    sync._control = SimpleNamespace(barrier=lambda timeout_s, phase: None, lost=None)
    received = engine_update.ReceivedShards(
        sync, Payload("u-1", 0, {0: 0}, {"w": shard}, {})
    )
    del shard
    request = SimpleNamespace(timeout_s=5.0, update_id="u-1")
    assert engine_update.end_of_update(received, request, True, "Success") == (
        True,
        "Success",
    )
    gc.collect()
    assert alive() is None and received.payload is None


def test_the_trainer_drops_its_shards_once_the_engine_answers():
    """The sender keeps what it sent alive while the engine maps it (CUDA IPC); the flow
    lets it go as soon as the answer is in, not at the next update."""
    from sglang.srt.weight_sync.delivery import ShardSender
    from sglang.srt.weight_sync.protocol import make_channel
    from sglang.srt.weight_sync.trainer_flow import delivered_flow

    channel = make_channel()
    sender = ShardSender(channel, 0)
    try:
        shard = torch.randn(16, 16)
        alive = weakref.ref(shard)
        sender._alive = [shard]  # what send() keeps for a CUDA payload
        del shard
        chan = SimpleNamespace(channel=channel, control=None, sender=sender)
        flow = delivered_flow(chan, "u-1")
        next(flow)
        gc.collect()
        assert alive() is not None  # the engine may still be reading it
        with pytest.raises(StopIteration) as done:
            flow.send((True, "Success"))
        assert done.value.value.success
        gc.collect()
        assert alive() is None
    finally:
        sender.close()
        import shutil

        shutil.rmtree(channel, ignore_errors=True)
