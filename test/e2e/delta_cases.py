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


def _wrong_params(model, job) -> dict:
    """Every server's parameters against SGLang's slicing of the trainer's weights (first
    rank: server -> names that differ; every rank takes part in the gather)."""
    from ranks import gathers_allowed
    from remote_cases import server_state
    from transformers import AutoConfig
    from update_checks import expected_checksums

    with gathers_allowed():
        weights = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    if dist.get_rank() != 0:
        return {}
    config = AutoConfig.from_pretrained(job["model_dir"])
    expected = expected_checksums(config, weights, job["tp"], 1)
    out = {}
    for url, state in zip(job["urls"], server_state(job["urls"], [[1, 2, 3]])):
        got = state["checksums"]
        out[url] = sorted(
            f"rank {r}: {n}"
            for r in range(job["tp"])
            for n in expected[r]
            if got[r][n] != expected[r][n]
        )
    return out


def delta_trainer_job(rank: int, world: int, job: dict) -> list:
    """Steps: ("train", lr) one optimizer step then one update; ("corrupt", flag file) the
    first rank creates the fault file (the engine flips a parameter bit before its next
    receive). Records every update's report, the loss and the servers' wrong parameters."""
    from remote_cases import fsdp2_model
    from torch.distributed.device_mesh import init_device_mesh

    from sglang.srt.weight_sync.remote_trainer import HttpEndpoint, RemoteSync

    init_device_mesh("cpu", (world,))
    model = fsdp2_model(job["model_dir"], 1, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    generator = torch.Generator().manual_seed(1234)
    vocab = model.config.vocab_size
    sync = RemoteSync(
        job["group"],
        "127.0.0.1",
        job["port"],
        engines=[HttpEndpoint(u) for u in job["urls"]],
        timeout_s=job["timeout"],
        delta=True,
        digest_every=1,
    )
    sync.join()
    records = []
    for kind, arg in job["steps"]:
        if kind == "corrupt":
            if rank == 0:
                open(arg, "w").close()
            dist.barrier()
            continue
        loss = None
        if kind == "train":
            for group in optimizer.param_groups:
                group["lr"] = arg
            loss = _train_step(model, optimizer, generator, vocab)
        report = sync.update(model.named_parameters(), bucket_bytes=job["bucket"])
        record = dict(report.__dict__, kind=kind, lr=arg, loss=loss)
        record["wrong"] = _wrong_params(model, job)
        records.append(record)
    dist.barrier()
    sync.close()
    return records
