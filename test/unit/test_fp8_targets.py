"""Block-FP8 targets as a transform (``weight_sync.fp8_targets``): which parameters are
quantized on the receiving rank, and the refusals, by tensor, block and reason, of layouts
whose pieces cut a 128-block."""

from __future__ import annotations

import torch

from benchmark.weight_sync.hand_rules import model_targets_from_config
from sglang.srt.weight_sync.apply import write_quantized
from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.fp8_quant import block_grid, quantize_block_fp8
from sglang.srt.weight_sync.fp8_targets import block_fp8_targets, staging_buffers
from sglang.srt.weight_sync.target_layout import EngineParallel, ParamTarget, Piece

E4M3 = torch.float8_e4m3fn
QWEN2 = dict(
    model_type="qwen2",
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=512,
    vocab_size=512,
    num_hidden_layers=1,
    tie_word_embeddings=False,
)


def _live(targets, quantized=lambda name: "proj.weight" in name):
    """The live parameters of a block-FP8 engine rank with these (unquantized) targets."""
    live = {}
    for t in targets:
        if quantized(t.name):
            live[t.name] = (t.shape, E4M3)
            live[t.name + "_scale_inv"] = (block_grid(t.shape), torch.float32)
        else:
            live[t.name] = (t.shape, t.dtype)
    return live


def _targets(tp: int, rank: int, **config):
    rules = model_targets_from_config({**QWEN2, **config}, EngineParallel(tp))
    return rules.for_rank(rank), rules.tensor_shapes()


def test_linear_weights_are_staged_in_bf16_and_the_rest_copied():
    targets, shapes = _targets(2, 1)
    t = block_fp8_targets(targets, _live(targets), shapes)
    assert not t.problems
    staged = {q.weight for q in t.quantized}
    assert staged == {n.name for n in targets if "proj.weight" in n.name}
    for target in t.targets:
        assert target.dtype == torch.bfloat16
    assert {q.scale for q in t.quantized} == {n + "_scale_inv" for n in staged}


def test_a_tp_split_that_cuts_a_block_is_refused_by_tensor_block_and_reason():
    # 4 kv heads of 32: k_proj has 128 rows, 64 per rank at TP 2 (SGLang refuses to build it)
    targets, shapes = _targets(2, 1, num_key_value_heads=4)
    t = block_fp8_targets(targets, _live(targets), shapes)
    text = [str(p) for p in t.problems]
    assert any(
        "model.layers.0.self_attn.k_proj.weight" in s
        and "block (0, 0)" in s
        and "piece 64:128 of dim 0 starts at 64, inside one of its 128-blocks" in s
        for s in text
    ), text


def test_a_parameter_without_its_scale_or_with_a_wrong_grid_is_refused():
    targets, shapes = _targets(1, 0)
    live = _live(targets)
    name = "model.layers.0.mlp.down_proj.weight"
    live.pop(name + "_scale_inv")
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    live[o_proj + "_scale_inv"] = ((1, 1), torch.float32)
    text = [str(p) for p in block_fp8_targets(targets, live, shapes).problems]
    assert any(name in s and "no float32" in s for s in text), text
    assert any(o_proj in s and "expected float32 (2, 2)" in s for s in text), text


def test_a_ragged_last_block_is_whole_only_at_both_ends():
    """A 200-row tensor: its last block has 72 rows. Alone in its parameter it is whole (the
    reference quantizes it as if padded); fused before another tensor the parameter's block
    would mix two tensors' rows, and both pieces are refused."""
    alone = ParamTarget(
        "a.weight",
        (200, 128),
        torch.bfloat16,
        (Piece("a", Box((0, 0), (200, 128)), (), (0, 0)),),
    )
    fused = ParamTarget(
        "f.weight",
        (328, 128),
        torch.bfloat16,
        (
            Piece("a", Box((0, 0), (200, 128)), (), (0, 0)),
            Piece("b", Box((0, 0), (128, 128)), (), (200, 0)),
        ),
    )
    shapes = {"a": (200, 128), "b": (128, 128)}
    live = {
        "a.weight": ((200, 128), E4M3),
        "a.weight_scale_inv": ((2, 1), torch.float32),
        "f.weight": ((328, 128), E4M3),
        "f.weight_scale_inv": ((3, 1), torch.float32),
    }
    t = block_fp8_targets([alone, fused], live, shapes)
    text = [str(p) for p in t.problems]
    assert len(text) == 2, text
    assert (
        "tensor 'a' block (1, 0)" in text[0]
        and "ends at 200 (of 200), inside a 128-block" in text[0]
    )
    assert "tensor 'b'" in text[1] and "lands at 200 of the parameter" in text[1]


def test_staged_blocks_quantize_into_the_parameters_in_place():
    targets, shapes = _targets(1, 0)
    t = block_fp8_targets(targets, _live(targets), shapes)
    staged = staging_buffers(t.quantized, torch.device("cpu"))
    params = {}
    for q in t.quantized:
        params[q.weight] = torch.zeros(q.shape, dtype=E4M3)
        params[q.scale] = torch.zeros(block_grid(q.shape), dtype=torch.float32)
        staged[q.weight].normal_(0, 0.02)
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    write_quantized(t.quantized, t.targets, staged, params)
    for q in t.quantized:
        ref_q, ref_s = quantize_block_fp8(staged[q.weight])
        assert torch.equal(params[q.weight].view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(params[q.scale], ref_s)
    assert ptrs == {n: p.data_ptr() for n, p in params.items()}


def test_derived_state_sglang_cannot_redo_is_refused_by_layer():
    """``sglang_compat.update_refusals``: layers whose FP8 weights SGLang's post-load step
    packed (CPU AMX), shuffled in place (ROCm aiter) or whose scales it requantized to UE8M0
    and marked (DeepGEMM) are named; a plain block-FP8 layer is not."""
    from sglang.srt.weight_sync.sglang_compat import update_refusals

    class Fp8LinearMethod:  # the name SGLang's method has; nothing else is read
        quant_config = None

    def layer(**attrs):
        m = torch.nn.Module()
        m.quant_method = Fp8LinearMethod()
        m.weight_scale_inv = torch.nn.Parameter(torch.ones(1, 1), requires_grad=False)
        for k, v in attrs.items():
            setattr(m, k, v)
        return m

    model = torch.nn.Module()
    model.plain = layer()
    model.amx = layer(use_intel_amx_backend=True)
    model.shuffled = layer(aiter_bpreshuffled=True)
    model.ue8m0 = layer()
    model.ue8m0.weight_scale_inv.format_ue8m0 = True
    found = update_refusals(model)
    assert [f.split(":")[0] for f in found] == ["amx", "shuffled", "ue8m0"], found
    assert "_amx_process_weight_after_loading" in found[0]
    assert "format_ue8m0" in found[2]


def _fsdp_sources(shapes, world):
    from torch.distributed.tensor import Shard

    from sglang.srt.weight_sync.source_layout import MeshSpec

    return {
        n: MeshSpec(tuple(s), torch.bfloat16, list(range(world)), (Shard(0),)).describe(
            n
        )
        for n, s in shapes.items()
    }


def test_block_sites_say_where_each_block_can_meet():
    """FSDP2 over 2 ranks cuts every tensor on a block boundary: every block lies whole in one
    rank's shard (a sender could quantize it); over 3 ranks most cuts fall inside blocks,
    which then meet only on the receiving rank."""
    from sglang.srt.weight_sync.fp8_targets import block_sites

    targets, shapes = _targets(1, 0)
    t = block_fp8_targets(targets, _live(targets), shapes)
    blocks = sum((q.shape[0] // 128) * (q.shape[1] // 128) for q in t.quantized)
    two = block_sites(_fsdp_sources(shapes, 2), t, t.targets, rank=0)
    assert (two.at_sender, two.at_receiver) == (blocks, 0)
    assert two.local == blocks // 2  # rank 0 holds the top half of every tensor
    three = block_sites(_fsdp_sources(shapes, 3), t, t.targets, rank=0)
    # 512-row gate/up are cut at 171 and 342: their row blocks 0 (rank 0) and 3 (rank 2) stay
    # whole, twice per tensor (2 column blocks); every 256-row tensor's blocks are cut
    assert (three.at_sender, three.local) == (2 * 2 * 2, 2 * 2)
    assert three.at_receiver == blocks - three.at_sender
