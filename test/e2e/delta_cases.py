"""What each trainer rank does in the delta-update test (``test_remote_delta``).

FSDP2 fp32 trainer ranks (``remote_cases.fsdp2_model``) train the tiny Qwen2 for real
(AdamW on a next-token loss over random token ids) and update bf16 SGLang servers through a
weight-sync group with ``delta=True`` after every optimizer step. After each update the
first rank compares every server's parameters (SGLang's own weight checker) with SGLang's
slicing of the trainer's current weights cast to bf16 (``update_checks.expected_checksums``):
what a full update would have written.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _train_step(model, optimizer, generator, vocab: int) -> float:
    ids = torch.randint(0, vocab, (2, 16), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _weights(model) -> dict:
    """The trainer's current fp32 weights, whole (every rank takes part in the gather)."""
    from ranks import gathers_allowed

    with gathers_allowed():
        return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def _wrong(weights: dict, job: dict, urls=None) -> dict:
    """Every server's (or ``urls``') parameters against SGLang's slicing of ``weights`` cast
    to bf16 (server -> names that differ; first rank only: {} elsewhere)."""
    from remote_cases import server_state
    from transformers import AutoConfig
    from update_checks import expected_checksums

    if dist.get_rank() != 0:
        return {}
    urls = job["urls"] if urls is None else urls
    config = AutoConfig.from_pretrained(job["model_dir"])
    # each server's TP size: ``job["tp"]``, or its own in ``job["tp_of"]`` (mixed layouts)
    tps = {url: job.get("tp_of", {}).get(url, job["tp"]) for url in urls}
    expected = {
        tp: expected_checksums(config, weights, tp, 1) for tp in set(tps.values())
    }
    out = {}
    for url, state in zip(urls, server_state(urls, [[1, 2, 3]])):
        got, want = state["checksums"], expected[tps[url]]
        out[url] = sorted(
            f"rank {r}: {n}"
            for r in range(tps[url])
            for n in want[r]
            if got[r][n] != want[r][n]
        )
    return out


def _wrong_params(model, job) -> dict:
    """Every server's parameters against the trainer's current weights (``_wrong``)."""
    return _wrong(_weights(model), job)


def _trainer(world: int, job: dict):
    """This rank's FSDP2 fp32 model of the tiny Qwen2, its AdamW, the batches' generator and
    its ``RemoteSync(delta=True)`` checking digests every update."""
    from remote_cases import fsdp2_model, group_of
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (world,))
    model = fsdp2_model(job["model_dir"], 1, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    generator = torch.Generator().manual_seed(1234)
    digest_every = job.get("digest_every", 1)
    return (
        model,
        optimizer,
        generator,
        group_of(job, delta=True, digest_every=digest_every),
    )


def delta_trainer_job(rank: int, world: int, job: dict) -> list:
    """Steps: ("full", None) one update; ("train", lr) one optimizer step then one update;
    ("corrupt", flag file) the first rank creates the fault file (the engine flips a
    parameter bit before its next receive); ("refuse", flag file) likewise, the engine
    refuses its next apply before any write; ("leave", url) that engine leaves the group;
    ("join", url) it joins again (a new membership epoch). Records every update's report,
    the loss and the servers' wrong parameters; the update after a fault also records
    ``wrong_before``: them against the weights before its step (what was delivered last)."""
    from sglang.srt.weight_sync.remote import HttpEndpoint

    model, optimizer, generator, sync = _trainer(world, job)
    vocab = model.config.vocab_size
    sync.join()
    records, after_fault = [], False
    for kind, arg in job["steps"]:
        if kind in ("corrupt", "refuse"):
            if rank == 0:
                open(arg, "w").close()
            dist.barrier()
            after_fault = True
            continue
        if kind == "leave":
            sync.leave(arg)
            continue
        if kind == "join":
            sync.join([HttpEndpoint(arg)])
            continue
        before = _weights(model) if after_fault else None
        loss = None
        if kind == "train":
            for group in optimizer.param_groups:
                group["lr"] = arg
            loss = _train_step(model, optimizer, generator, vocab)
        report = sync.update(model.named_parameters(), bucket_bytes=job["bucket"])
        record = dict(report.__dict__, kind=kind, lr=arg, loss=loss)
        record["wrong"] = _wrong_params(model, job)
        if before is not None:
            record["wrong_before"] = _wrong(before, job)
        after_fault = False
        records.append(record)
    dist.barrier()
    sync.close()
    return records


def delta_death_job(rank: int, world: int, job: dict) -> dict:
    """A trainer rank dies in the middle of a delta update: one full update, one AdamW step
    and a delta update, another step, then trainer rank 1 exits inside its first round of
    delta records (``delta_rounds``'s exchange). Returns (first rank) the reports, what the
    update that lost a rank raised or reported and how long it took, and the servers'
    parameters against the weights delivered last and the new ones."""
    import os
    import time

    from sglang.srt.weight_sync import delta_rounds as delta

    model, optimizer, generator, sync = _trainer(world, job)
    vocab = model.config.vocab_size
    out = {"reports": []}
    for step in range(2):
        if step:
            _train_step(model, optimizer, generator, vocab)
        report = sync.update(model.named_parameters(), bucket_bytes=job["bucket"])
        out["reports"].append(dict(report.__dict__))
    delivered = _weights(model)  # what the engines hold
    _train_step(model, optimizer, generator, vocab)
    new = _weights(model)
    if rank == 1:

        def die(*args, **kwargs):
            os._exit(0)  # killed in the middle of sending its delta records

        delta.exchange_round = die
    started = time.monotonic()
    try:
        report = sync.update(model.named_parameters(), bucket_bytes=job["bucket"])
        out["died"] = dict(report.__dict__)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        out["died"] = {"success": False, "raised": f"{type(e).__name__}: {e}"}
    out["died"]["seconds_here"] = time.monotonic() - started
    out["stale"] = _wrong(delivered, job)
    out["new"] = _wrong(new, job)
    return out


def _undriven_update(sync, model, job) -> dict:
    """One update with ``drive=False``: the first rank sends each engine its update request
    itself (as verl's rollout workers do), so the trainer never hears the answers; the
    report, with the engines' answers (first rank) under ``heard_here``."""
    import concurrent.futures

    from sglang.srt.weight_sync.remote import HttpEndpoint

    if sync.group is None or sync.broken:  # a new epoch first (verl: build_topology)
        sync.join()
    body = dict(group_name=job["group"], timeout_s=job["timeout"])
    with concurrent.futures.ThreadPoolExecutor(len(job["urls"])) as pool:
        asked = {
            url: pool.submit(HttpEndpoint(url).update, body, 300)
            for url in (job["urls"] if dist.get_rank() == 0 else ())
        }
        report = sync.update(
            model.named_parameters(), bucket_bytes=job["bucket"], drive=False
        )
        heard = {url: f.result() for url, f in asked.items()}
    return dict(report.__dict__, heard_here=heard)


def delta_undriven_job(rank: int, world: int, job: dict) -> list:
    """A trainer that does not hear the engines' answers (``drive=False``, verl's way), with
    digests every ``job["digest_every"]``-th update only: a full update, a delta after an
    AdamW step, then engine 0 refuses the next delta in its apply step (``job["flag"]``),
    then three more steps and updates. Records each update's report, the engines' answers and
    the servers' wrong parameters; from the refused one on, also engine 0's against the
    weights of the last update it took before (``wrong_kept``)."""
    model, optimizer, generator, sync = _trainer(world, job)
    vocab = model.config.vocab_size
    sync.join()
    records, kept = [], None
    for step in range(6):
        if step:
            _train_step(model, optimizer, generator, vocab)
        if step == 2:
            if rank == 0:
                open(job["flag"], "w").close()
            dist.barrier()
        record = _undriven_update(sync, model, job)
        weights = _weights(model)
        record["wrong"] = _wrong(weights, job)
        if step == 1:
            kept = weights  # engine 0's last update before it refuses
        if step in (2, 3):
            record["wrong_kept"] = _wrong(kept, job, job["urls"][:1])
        records.append(record)
    dist.barrier()
    sync.close()
    return records


def _row(report) -> dict:
    """The figures of one update that the delta benchmark reports."""
    engines = list(report.engines.values())
    return dict(
        success=report.success,
        message=report.message[:300],
        seconds=report.seconds,
        bytes_sent=sum(report.bytes_sent),
        pause_seconds=max((e.get("pause_seconds", 0) for e in engines), default=0),
        decode_seconds=max(
            (max(e.get("decode_us") or [0]) / 1e6 for e in engines), default=0
        ),
        delta=report.delta,
    )


def delta_bench_job(rank: int, world: int, job: dict) -> list:
    """``benchmark.weight_sync.delta_run``: after every AdamW step (each of ``job["lrs"]``
    for ``job["steps"]`` steps), one full update through a group of its own and one delta
    update through another, to the same servers (both write the same values). Returns one
    row per step (first rank)."""
    from remote_cases import fsdp2_model, group_of
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (world,))
    model = fsdp2_model(job["model_dir"], 1, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["lrs"][0], foreach=False)
    generator = torch.Generator().manual_seed(1234)
    syncs = {
        mode: group_of(
            dict(job, group=f"bench-{mode}", port=port),
            delta=mode == "delta",
            digest_every=job["digest_every"],
        )
        # the delta update first: the full one then writes the values it delivered, so the
        # server still holds the delta group's snapshot (the other order changes it behind
        # that group's back, which its digest check refuses)
        for mode, port in (("delta", job["ports"][1]), ("full", job["ports"][0]))
    }
    for sync in syncs.values():
        sync.join()
        sync.update(model.named_parameters(), bucket_bytes=job["bucket"])
    rows = []
    for lr in job["lrs"]:
        for group in optimizer.param_groups:
            group["lr"] = lr
        for step in range(job["steps"]):
            loss = _train_step(model, optimizer, generator, model.config.vocab_size)
            row = dict(lr=lr, step=step, loss=loss)
            for mode, sync in syncs.items():
                report = sync.update(
                    model.named_parameters(), bucket_bytes=job["bucket"]
                )
                row[mode] = _row(report)
            rows.append(row)
    dist.barrier()
    for sync in syncs.values():
        sync.close()
    return rows


def megatron_delta_job(rank: int, world: int, job: dict) -> list:
    """A megatron-core GPTModel at TP x PP (``remote_cases.megatron_trainer_job``'s) updates
    one server with ``delta=True``: first the weights of ``job["seed"]``, then
    ``job["steps"]`` Adam-sized steps (every fp32 weight moved by ``job["lr"]`` with a
    random sign, the same on every rank), each written into the model's fused parameters;
    with ``job["refuse"]`` = (step, fault file) the first rank creates the file before that
    step's update (the engine refuses its apply). Returns each update's report and the
    server's wrong parameters (first rank; the refused one's also against the weights
    before it, ``wrong_before``)."""
    import tiny_models
    from megatron_cases import build_gpt, load_hf_weights
    from remote_cases import group_of, server_state
    from transformers import AutoConfig
    from update_cases import new_weights
    from update_checks import expected_checksums

    hf_config = tiny_models.tiny_config("qwen2")
    model = build_gpt(hf_config, job["tp"], job["pp"], job["padded_vocab"])
    weights = {
        n: t.float() for n, t in new_weights(job["model_dir"], job["seed"]).items()
    }
    generator = torch.Generator().manual_seed(99)
    sync = group_of(job, delta=True, digest_every=1)
    sync.join()
    config = AutoConfig.from_pretrained(job["model_dir"])
    records, expected = [], None
    refuse_at, flag = job.get("refuse", (None, None))
    for step in range(job["steps"] + 1):
        if step:
            for name in sorted(weights):
                noise = torch.randn(weights[name].shape, generator=generator)
                weights[name] += job["lr"] * noise.sign()
        if step == refuse_at:
            if rank == 0:
                open(flag, "w").close()
            dist.barrier()
        load_hf_weights(model, weights, hf_config.vocab_size)
        report = sync.update_megatron(
            [model], hf_config.vocab_size, bucket_bytes=job["bucket"]
        )
        record = dict(report.__dict__)
        dist.barrier()
        if rank == 0:
            before = expected
            expected = expected_checksums(config, weights, job["engine_tp"], 1)
            [state] = server_state(job["urls"], [[1, 2, 3]])

            def wrong(against):
                return sorted(
                    f"rank {r}: {n}"
                    for r in range(job["engine_tp"])
                    for n in against[r]
                    if state["checksums"][r][n] != against[r][n]
                )

            record["wrong"] = wrong(expected)
            if step == refuse_at:
                record["wrong_before"] = wrong(before)
        records.append(record)
    dist.barrier()
    sync.close()
    return records


def _reshard_once(sync, model, manifest, groups, bucket: int, delta) -> dict:
    """One trainer-side update of this rank's buffers (the agreement, then every chunk),
    without an engine: its buffers, the bytes it exchanged, its seconds and the delta's
    summary."""
    import time

    from sglang.srt.weight_sync.phase_timing import PhaseClock
    from sglang.srt.weight_sync.trainer_flow import agree_on_inputs, prepare_shards

    rank = dist.get_rank()
    dist.barrier()
    start = time.perf_counter()
    shards = prepare_shards(list(model.named_parameters()))
    sources = {n: spec.describe(n) for n, _, spec in shards}
    local = {n: t for n, t, _ in shards}
    parts = agree_on_inputs(
        sync, sources, local, manifest, groups, bucket, 120, PhaseClock(), delta
    )
    buffers, received, sent = {}, 0, 0
    for part in parts:
        result = sync.plans.reshard_to_engines(
            sources,
            local,
            manifest,
            groups,
            rank,
            bucket,
            part,
            120,
            sync.data,
            checked=True,
            delta=delta,
        )
        buffers.update({n: b.clone() for n, b in result.buffers.items()})
        received += result.stats.bytes_received
        sent += result.stats.bytes_sent
    seconds = time.perf_counter() - start
    summary = {}
    if delta is not None:
        summary = delta.summary()
        delta.commit()
    return dict(
        buffers=buffers, received=received, sent=sent, seconds=seconds, delta=summary
    )


def reshard_delta_bench_job(rank: int, world: int, job: dict) -> list:
    """``benchmark.weight_sync.reshard_delta_run``: after every AdamW step (each of
    ``job["lrs"]`` for ``job["steps"]`` steps), the trainer-side buffers of two bf16
    engines of TP 2 beside the ranks filled twice, in full and as a delta (each through the
    agreement, with a ``TrainerSync`` of its own); the delta's buffers must equal the full
    update's bit for bit. Returns one row per step (max over ranks of bytes and seconds)."""
    from remote_cases import fsdp2_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig

    from benchmark.weight_sync.hand_rules import model_targets_from_config
    from sglang.srt.weight_sync.manifest import EngineManifest
    from sglang.srt.weight_sync.reshard_delta import ReshardDelta
    from sglang.srt.weight_sync.target_layout import EngineParallel
    from sglang.srt.weight_sync.trainer_flow import TrainerSync

    init_device_mesh("cpu", (world,))
    model = fsdp2_model(job["model_dir"], 1, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["lrs"][0], foreach=False)
    generator = torch.Generator().manual_seed(1234)
    config = AutoConfig.from_pretrained(job["model_dir"])
    manifest = EngineManifest.of(
        model_targets_from_config(config, EngineParallel(2), torch.bfloat16)
    )
    groups = [list(range(j, j + 2)) for j in range(0, world, 2)]
    full_sync, delta_sync = TrainerSync(), TrainerSync()
    delta_sync.delta = ReshardDelta()

    def both() -> dict:
        full = _reshard_once(full_sync, model, manifest, groups, job["bucket"], None)
        delta = _reshard_once(
            delta_sync, model, manifest, groups, job["bucket"], delta_sync.delta
        )
        same = full["buffers"].keys() == delta["buffers"].keys() and all(
            torch.equal(b, delta["buffers"][n]) for n, b in full["buffers"].items()
        )
        mine = [
            full["received"],
            full["seconds"],
            delta["received"],
            delta["seconds"],
            delta["delta"]["encode_seconds"],
            delta["delta"]["decode_seconds"],
            float(not same),
        ]
        every = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(every, op=dist.ReduceOp.MAX)
        keys = (
            "full_bytes",
            "full_seconds",
            "delta_bytes",
            "delta_seconds",
            "encode_seconds",
            "decode_seconds",
            "differ",
        )
        row = dict(zip(keys, every.tolist()))
        row.update(
            mode=delta["delta"]["mode"],
            density=delta["delta"]["density"],
            kept_bytes=delta["delta"]["kept_bytes"],
        )
        return row

    rows = [dict(lr=None, step=-1, loss=None, **both())]
    for lr in job["lrs"]:
        for group in optimizer.param_groups:
            group["lr"] = lr
        for step in range(job["steps"]):
            loss = _train_step(model, optimizer, generator, model.config.vocab_size)
            rows.append(dict(lr=lr, step=step, loss=loss, **both()))
    dist.barrier()
    full_sync.close()
    delta_sync.close()
    return rows
