"""Delta updates of the trainer-side hop against real engines on CPU (``reshard_delta``).

Four fp32 FSDP ranks update two bf16 engines of TP 2 trainer-side, with
``weight_sync_delta``: the trainer ranks send each other only what changed since the
last update, and every engine still receives whole buffers. After every update each
engine's parameters are bit-exact (SGLang's slicing of the new weights) and its greedy
generation is HF transformers'; the reports say full or delta, why, and the bytes.
"""

from __future__ import annotations

import json

from update_checks import check_update, run


def test_delta_updates_of_the_trainer_side_hop_are_exact(tmp_path):
    """The first update is full, at the lower bound; then new weights (every value
    changed: the records carry whole regions, at most 1 % over a full update) and the same
    weights again (nothing changed: headers only), as deltas. Then an update both engines
    refuse (their weights released: the trainer ranks drop their bases), after which the
    next is full, at the lower bound, and the one after a delta again. Every applied
    update exact on both engines; the refused one changed nothing."""
    steps = [
        ("verl", "fsdp32", 1),
        ("verl", "fsdp32", 2),
        ("verl", "fsdp32", 2),
        ("released", "fsdp32", 3),
        ("verl", "fsdp32", 3),
        ("verl", "fsdp32", 4),
    ]
    applied = [s for s in steps if s[0] == "verl"]
    (tmp_path / "reports").mkdir()
    model_dir, config, prompts, engines = run(
        "qwen2",
        2,
        4,
        steps,
        tmp_path,
        reports_dir=str(tmp_path / "reports"),
        weight_sync_mode="trainer",
        weight_sync_delta=True,
    )
    assert len(engines) == 2
    for records in engines:
        assert [r["step"] for r in records[1:]] == steps
        last = records[0]
        for record in records[1:]:
            if record["step"][0] == "released":
                assert record["success"] is False, record
                assert record["checksums"] == last["checksums"], "a refusal wrote"
                continue
            check_update(record, model_dir, config, record["step"][2], 2, prompts)
            last = record
    for rank in range(4):
        lines = (tmp_path / "reports" / f"rank{rank}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        assert [r["step"] for r in rows] == [list(s) for s in applied]
        for i, r in enumerate(rows):
            d, what = r["delta"], f"rank {rank}, update {i}"
            assert r["mode"] == "trainer", (what, r["mode"])
            assert d["full_bytes_received"] == r["lower_bound_bytes"] > 0, (what, d)
            assert d["bytes_received"] == r["bytes_received"], (what, d, r)
            if i in (0, 3):
                why = "no update delivered yet" if i == 0 else "did not apply"
                assert d["mode"] == "full" and why in d["why_full"], (what, d)
                assert r["bytes_received"] == r["lower_bound_bytes"], (what, r)
                continue
            assert d["mode"] == "delta" and d["digest_checked"], (what, d)
            assert d["bytes_received"] <= 1.01 * d["full_bytes_received"], (what, d)
            assert d["kept_bytes"] > 0, (what, d)
        same = rows[2]["delta"]
        assert same["density"] == 0 and same["regions"]["delta"] == 0, same
        assert same["bytes_received"] < 0.02 * same["full_bytes_received"], same
        assert rows[1]["delta"]["density"] > 0.9, rows[1]["delta"]
