"""A 7-8B-shaped model's weight update on one GPU, three ways side by side in one run.

* ``distributed``: ``weight_sync.utils.update_weights`` (what verl calls), through this
  package's path: the trainer's tensors travel through CUDA IPC and land in place.
* ``flattened_bucket``: upstream's bucketed tensor path as RL frameworks drive it:
  ``FlattenedTensorBucket`` copies of up to ``--bucket-mib`` each, serialised for CUDA IPC and
  sent with ``Engine.update_weights_from_tensor(load_format="flattened_bucket")``.
* ``d2d_copy``: a device-to-device copy of the same bytes into preallocated tensors, the floor.

The engine loads dummy weights (``load_format="dummy"``: only config.json on disk), TP 1,
Triton attention, CUDA graphs on; the trainer (this process) holds bf16 tensors in HF layout,
so every path moves the same bytes. Each path runs ``--warmup`` times, then ``--repeat`` timed
runs (wall clock, device synchronised). Prints a table; ``--json PATH`` writes the figures.
Run through ``scripts/gpu_run.sh``'s environment: ``bash scripts/gpu_run.sh --bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import torch

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def hf_tensors(config) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of every tensor of a Llama checkpoint with ``config``."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    out = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,))]
    out.append(("lm_head.weight", (v, h)))
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.mlp.gate_proj.weight", (i, h)),
            (f"{p}.mlp.up_proj.weight", (i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
        ]
    return out


def timed(fn: Callable[[], None], warmup: int, repeat: int) -> List[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=LLAMA3_8B["num_hidden_layers"])
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--log-level",
        default="error",
        help="the engine's; 'info' prints each update's phase line per rank",
    )
    args = ap.parse_args()

    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import sglang
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    from sglang.srt.weight_sync.utils import update_weights

    config = transformers.LlamaConfig(
        **{**LLAMA3_8B, "num_hidden_layers": args.layers}, dtype="bfloat16"
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.cuda.set_device(0)
    from ports import free_port  # test/support, on PYTHONPATH under scripts/gpu_run.sh

    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("infer_tp",))
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [
        (n, torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16))
        for n, s in hf_tensors(config)
    ]
    total = sum(t.numel() * t.element_size() for _, t in params)

    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        engine = sglang.Engine(
            model_path=model_dir,
            load_format="dummy",
            tp_size=1,
            dtype="bfloat16",
            attention_backend="triton",
            sampling_backend="pytorch",
            grammar_backend="none",
            skip_tokenizer_init=True,
            mem_fraction_static=0.35,
            cuda_graph_max_bs=4,
            disable_piecewise_cuda_graph=True,
            log_level=args.log_level,
        )
        try:

            class Client:  # what verl hands update_weights
                async def update_weights_from_tensor(self, req):
                    return await engine.tokenizer_manager.update_weights_from_tensor(
                        req, None
                    )

            def distributed() -> None:
                out = engine.loop.run_until_complete(
                    update_weights(
                        Client(), params, "infer_tp", mesh, flush_cache=False
                    )
                )
                assert out[0], out

            monkey_patch_torch_reductions()
            cap = args.bucket_mib << 20

            def flattened_bucket() -> None:
                chunk: List[Tuple[str, torch.Tensor]] = []
                size = 0
                for name, t in params + [("", None)]:
                    nbytes = 0 if t is None else t.numel() * t.element_size()
                    if chunk and (t is None or size + nbytes > cap):
                        bucket = FlattenedTensorBucket(named_tensors=chunk)
                        payload = {
                            "flattened_tensor": bucket.get_flattened_tensor(),
                            "metadata": bucket.get_metadata(),
                        }
                        serialized = MultiprocessingSerializer.serialize(
                            payload, output_str=True
                        )
                        ok, message = engine.update_weights_from_tensor(
                            [serialized],
                            load_format="flattened_bucket",
                            flush_cache=False,
                        )[:2]
                        assert ok, message
                        chunk, size = [], 0
                    if t is not None:
                        chunk.append((name, t))
                        size += nbytes

            dest = [torch.empty_like(t) for _, t in params]

            def d2d_copy() -> None:
                for d, (_, t) in zip(dest, params):
                    d.copy_(t)

            rows: Dict[str, List[float]] = {}
            for name, fn in (
                ("d2d_copy", d2d_copy),
                ("distributed", distributed),
                ("flattened_bucket", flattened_bucket),
                ("distributed_again", distributed),
            ):
                rows[name] = timed(fn, args.warmup, args.repeat)
        finally:
            engine.shutdown()

    floor = statistics.median(rows["d2d_copy"])
    result = {
        "device": torch.cuda.get_device_name(),
        "model": f"Llama-3-8B-shaped, {args.layers} layers",
        "bytes": total,
        "bucket_mib": args.bucket_mib,
        "seconds": rows,
        "median_s": {k: statistics.median(v) for k, v in rows.items()},
        "x_d2d_copy": {k: statistics.median(v) / floor for k, v in rows.items()},
    }
    print(f"{result['model']}: {total / 2**30:.2f} GiB bf16 on {result['device']}")
    print(f"{'path':<20}{'median s':>10}{'GB/s':>10}{'x d2d copy':>12}")
    for k in rows:
        med = result["median_s"][k]
        print(f"{k:<20}{med:>10.4f}{total / med / 1e9:>10.1f}{med / floor:>12.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.set_event_loop(asyncio.new_event_loop())
    main()
