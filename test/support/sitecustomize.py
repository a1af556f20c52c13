"""Test-only: in every Python process started with ``test/support`` on PYTHONPATH (the
engine's scheduler processes too), record calls that a weight update must never make.

Active only when ``SGLANG_TEST_FORBIDDEN_LOG`` names a directory: each call of
``DTensor.full_tensor``, ``gather_object`` or ``all_gather_object`` appends a line to
``<dir>/<pid>.log``. The end-to-end tests read those files around every update.
(Outside updates SGLang's own weight checker uses ``all_gather_object``, so the calls
are recorded rather than refused.)

When ``SGLANG_TEST_FIGURES_LOG`` names a directory, the numbers of each engine rank's
"received ... bytes (lower bound ...)" log record of ``weight_sync.engine_update`` are
appended to ``<dir>/<pid>.jsonl`` as [update_id, rank, received, lower_bound, staged]:
the tensor path's reply keeps upstream's shape, so its figures are only in that log.

When ``SGLANG_TEST_FAULT_DIR`` names a directory, an engine rank whose executor has
written its parameters raises if ``<dir>/fail_after_writes.rank<R>`` exists (the file
is removed: one fault per file): a peer lost after writes began, on demand. And engine
rank R's provenance check sees SGLang's ``gate_up_proj`` loaders swap gate and up if
``<dir>/permute_gate_up.rank<R>`` exists (removed likewise): a loader permutation the
derived targets do not know. And the whole engine (its process group) is killed once
engine rank R's staging took its first round of a remote update if
``<dir>/die_in_receive.rank<R>`` exists: an engine that dies mid-update. And one bit of
engine rank R's first ``down_proj`` weight flips before it receives a remote update if
``<dir>/corrupt_param.rank<R>`` exists: a parameter changed behind the trainer's back.
And engine rank R's next remote apply step refuses the update before any write if
``<dir>/refuse_apply.rank<R>`` exists: an engine that received everything and answers
failure.

With ``SGLANG_USE_CPU_ENGINE`` set (every engine the tests start), SGLang's weight checker on
0.5.10.post1 and 0.5.12 also takes the action ``checksums_to:<dir>``: every TP rank writes its
parameters' checksums there (``_checksums_to``).

When ``SGLANG_TEST_PARAM_PTRS`` names a directory, the scheduler gains
``test_dump_param_ptrs(tag)`` (called through ``Engine.collective_rpc``): each rank writes its
live parameters' ``data_ptr``s there, so a test can check an update wrote in place; and
``test_dump_data_group(tag)``: each rank writes the name of its weight sync's data group
(null when it holds none), so a test can tell a new group from the old one.

Each hook is installed when its variable is set (``install()``, at startup) and reads the
variable when called. A scheduler or detokenizer forked from its launching process's zygote
(``zygote``, imported first here so that it records what every import reads) inherits the
zygote's hooks and runs ``install()`` again under the environment of the launching process.
"""

import os

import zygote  # first: it records the variables that imports read


def _on_import(name: str, patch) -> None:
    """Run ``patch(module)`` right after module ``name`` is first loaded (the scheduler
    imports SGLang's modules late, so they cannot be patched from here directly), or now if
    it is loaded (a process forked from a zygote that imported it)."""
    import importlib.abc
    import importlib.util
    import sys

    if name in sys.modules:
        patch(sys.modules[name])
        return

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchOnImport())


# Each hook is installed once per process, when its variable is set (``install``), and reads
# the variable when called: a process forked from a zygote runs ``install()`` again with the
# environment of the process that started it, which may name other directories or none.
_INSTALLED = set()


def _once(hook: str) -> bool:
    if hook in _INSTALLED:
        return False
    _INSTALLED.add(hook)
    return True


def _install_forbidden_log() -> None:
    import torch.distributed as _dist
    import torch.distributed.distributed_c10d as _c10d
    from torch.distributed.tensor import DTensor as _DTensor

    def _recording(name, fn):
        def call(*args, **kwargs):
            log_dir = os.environ.get("SGLANG_TEST_FORBIDDEN_LOG")
            if log_dir:
                with open(os.path.join(log_dir, f"{os.getpid()}.log"), "a") as log:
                    log.write(name + "\n")
            return fn(*args, **kwargs)

        return call

    _DTensor.full_tensor = _recording("full_tensor", _DTensor.full_tensor)
    for _name in ("gather_object", "all_gather_object"):
        _wrapped = _recording(_name, getattr(_c10d, _name))
        setattr(_dist, _name, _wrapped)
        setattr(_c10d, _name, _wrapped)


def _install_figures_log() -> None:
    import json as _json
    import logging as _logging

    class _FigureRecorder(_logging.Handler):
        def emit(self, record):
            figures_dir = os.environ.get("SGLANG_TEST_FIGURES_LOG")
            if figures_dir and "received %d bytes (lower bound %d)" in str(record.msg):
                with open(
                    os.path.join(figures_dir, f"{os.getpid()}.jsonl"), "a"
                ) as log:
                    log.write(_json.dumps(list(record.args)) + "\n")

    _figures_logger = _logging.getLogger("sglang.srt.weight_sync.engine_update")
    _figures_logger.setLevel(_logging.INFO)
    _figures_logger.addHandler(_FigureRecorder())


def _fault_flag(name: str):
    """``<SGLANG_TEST_FAULT_DIR>/<name>`` if it exists, removed (one fault per file); else None."""
    fault_dir = os.environ.get("SGLANG_TEST_FAULT_DIR")
    flag = fault_dir and os.path.join(fault_dir, name)
    if not flag or not os.path.exists(flag):
        return None
    os.unlink(flag)
    return flag


def _install_faults() -> None:
    def _fail_after_writes(execute):
        def call(*args, **kwargs):
            stats = execute(*args, **kwargs)
            if _fault_flag(f"fail_after_writes.rank{args[1]}"):
                raise RuntimeError(
                    f"engine rank {args[1]}: fault injected by the test after its writes"
                )
            return stats

        return call

    def _wrap_execute(module):
        module.execute = _fail_after_writes(module.execute)

    _on_import("sglang.srt.weight_sync.engine_update", _wrap_execute)

    def _planted_permutation(check):
        """Swap gate and up in every live ``gate_up_proj``'s weight_loader for one provenance
        check of engine rank R when ``<dir>/permute_gate_up.rank<R>`` exists (removed: one per
        file): a shape-preserving permutation the derived targets do not know, on demand."""

        def call(model, targets, shapes, rank, *args, **kwargs):
            if not _fault_flag(f"permute_gate_up.rank{rank}"):
                return check(model, targets, shapes, rank, *args, **kwargs)
            planted = []
            for name, p in model.named_parameters():
                if name.endswith("gate_up_proj.weight"):
                    attr = (
                        "weight_loader"
                        if "weight_loader" in vars(p)
                        else "_weight_loader"
                    )
                    loader = getattr(p, attr)
                    planted.append((p, attr, loader))
                    setattr(
                        p,
                        attr,
                        lambda param, w, shard_id=None, *a, _load=loader, **k: _load(
                            param, w, 1 - shard_id, *a, **k
                        ),
                    )
            try:
                return check(model, targets, shapes, rank, *args, **kwargs)
            finally:
                for p, attr, loader in planted:
                    setattr(p, attr, loader)

        return call

    def _wrap_check(module):
        module.check_provenance = _planted_permutation(module.check_provenance)

    _on_import("sglang.srt.weight_sync.derive.provenance_check", _wrap_check)

    def _die_in_receive(landed):
        """Kill the whole engine (its process group) once engine rank R's staging took its
        first round of a remote update, if ``<dir>/die_in_receive.rank<R>`` exists
        (removed): an engine that dies mid-update, on demand."""

        def call(self, landings):
            landed(self, landings)
            rank = int(self.who.rsplit("TP rank ", 1)[-1])
            if _fault_flag(f"die_in_receive.rank{rank}"):
                import signal

                os.killpg(os.getpgrp(), signal.SIGKILL)

        return call

    def _corrupt_param(receive):
        """Before engine rank R receives a remote update, change one bit of its first
        ``down_proj`` weight if ``<dir>/corrupt_param.rank<R>`` exists (removed): a
        parameter changed behind the trainer's back, on demand."""

        def call(self, worker, req):
            if _fault_flag(f"corrupt_param.rank{self.rank}"):
                import torch as _torch

                for name, p in worker.model_runner.model.named_parameters():
                    if name.endswith("down_proj.weight"):
                        bits = p.data.view(-1)[:1].view(_torch.int16)
                        bits.bitwise_xor_(1)
                        break
            return receive(self, worker, req)

        return call

    def _refuse_apply(apply):
        """Engine rank R's next remote apply step finds its receive failed, and so the whole
        engine refuses the update before any write, if ``<dir>/refuse_apply.rank<R>`` exists
        (removed): an engine that received every region and still answers failure (a
        refusal the trainer learns of only from the engine's reply), on demand."""

        def call(self, worker, req):
            mine = self.receive_of(req)
            if mine is not None and _fault_flag(f"refuse_apply.rank{self.rank}"):
                mine.error = (
                    f"engine rank {self.rank}: the update is refused before any write "
                    "(fault injected by the test)"
                )
            return apply(self, worker, req)

        return call

    def _wrap_staging(module):
        module.Staging.landed = _die_in_receive(module.Staging.landed)
        module.RemoteEngineSync.receive = _corrupt_param(
            module.RemoteEngineSync.receive
        )
        module.RemoteEngineSync.apply = _refuse_apply(module.RemoteEngineSync.apply)

    _on_import("sglang.srt.weight_sync.remote.engine", _wrap_staging)


def _install_cpu_engine() -> None:
    import torch as _torch

    if _torch.version.cuda is not None and not _torch.cuda.is_available():
        # The CUDA torch build that SGLang 0.5.10/0.5.12 pin, on a machine without GPU: SGLang 0.5.12's
        # weight checker calls torch.cuda.synchronize(), which has nothing to wait for here.
        _torch.cuda.synchronize = lambda device=None: None

    def _checksums_to(check_weights):
        """``/weights_checker`` with action ``checksums_to:<dir>``: each TP rank writes
        {parameter: checksum} of its live model to ``<dir>/rank<R>of<N>.json`` (the checkers of
        0.5.10.post1 and 0.5.12 report no checksum or TP rank 0's only; a server has no
        ``save_sharded_model`` route): what ``update_cases.checksums`` reads over HTTP."""

        def call(self, recv_req):
            prefix = "checksums_to:"
            if not recv_req.action.startswith(prefix):
                return check_weights(self, recv_req)
            import json

            from sglang.srt.managers.io_struct import CheckWeightsReqOutput
            from sglang.srt.managers.mm_utils import tensor_hash

            model = self.tp_worker.model_runner.model
            sums = {
                n: f"{tensor_hash(p.data):016x}" for n, p in model.named_parameters()
            }
            path = os.path.join(
                recv_req.action[len(prefix) :],
                f"rank{self.tp_rank}of{self.tp_size}.json",
            )
            with open(path + ".tmp", "w") as out:
                json.dump(sums, out)
            os.rename(path + ".tmp", path)
            return CheckWeightsReqOutput(success=True, message="Success.")

        return call

    def _add_checksums_to(module):
        mixin = module.SchedulerUpdateWeightsMixin
        mixin.check_weights = _checksums_to(mixin.check_weights)

    _on_import("sglang.srt.managers.scheduler_update_weights_mixin", _add_checksums_to)


def _install_param_ptrs() -> None:
    import json as _json

    def _dump_param_ptrs(self, tag: str) -> None:
        """``Engine.collective_rpc("test_dump_param_ptrs", tag=...)``: each rank writes
        ``<dir>/<tag>.rank<R>.json``, {name: [data_ptr, dtype, shape]} of its live model."""
        worker = self.tp_worker
        runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
        ptrs = {
            name: [p.data_ptr(), str(p.dtype), list(p.shape)]
            for name, p in runner.model.named_parameters()
        }
        path = os.path.join(
            os.environ["SGLANG_TEST_PARAM_PTRS"], f"{tag}.rank{self.tp_rank}.json"
        )
        with open(path, "w") as out:
            _json.dump(ptrs, out)

    def _dump_data_group(self, tag: str) -> None:
        """``Engine.collective_rpc("test_dump_data_group", tag=...)``: each rank writes
        ``<dir>/<tag>.rank<R>.json``, the name of its weight sync's data group, or null."""
        from sglang.srt.weight_sync.sglang_compat import tp_state

        sync = getattr(self.tp_worker, "_weight_sync", None)
        data = getattr(sync, "_data", None)
        name = data.group.group_name if data is not None else None
        path = os.path.join(
            os.environ["SGLANG_TEST_PARAM_PTRS"], f"{tag}.rank{tp_state().rank}.json"
        )
        with open(path, "w") as out:
            _json.dump(name, out)

    def _add_ptr_dump(module):
        module.Scheduler.test_dump_param_ptrs = _dump_param_ptrs
        module.Scheduler.test_dump_data_group = _dump_data_group

    _on_import("sglang.srt.managers.scheduler", _add_ptr_dump)


_HOOKS = {
    "SGLANG_TEST_FORBIDDEN_LOG": _install_forbidden_log,
    "SGLANG_TEST_FIGURES_LOG": _install_figures_log,
    "SGLANG_TEST_FAULT_DIR": _install_faults,
    "SGLANG_USE_CPU_ENGINE": _install_cpu_engine,
    "SGLANG_TEST_PARAM_PTRS": _install_param_ptrs,
}


def install() -> None:
    """Install the hooks whose variable this process's environment sets (each once)."""
    for variable, hook in _HOOKS.items():
        if os.environ.get(variable) and _once(variable):
            hook()


install()
# SGLang's schedulers and detokenizer from a zygote of the process that starts them: one
# forked when it first does (a test server's, an adapter's server process), after it
# imported them itself.
zygote.install()
