"""Which modules of ``sglang.srt.weight_sync`` make up each end of an update (docs/design.md,
"Modules"): ``test_house.py`` checks that neither end imports the other, and
``test_installed_wheel.py`` that an engine process does not load the trainer's end."""

__all__ = ["ENGINE_END", "TRAINER_END"]

# What both ends use (protocol, delivery, the planes, the layouts, remote.group) belongs to
# neither.
ENGINE_END = {
    "engine_update",
    "engine_layout",
    "engine_trainer_side",
    "tensor_path",
    "commit_vote",
    "sessions",
    "answer_guard",
    "delivered",
    "remote.engine",
    "remote.requests",
    "framework_routes",
}
TRAINER_END = {
    "trainer_flow",
    "trainer_reshard",
    "megatron_flow",
    "remote.trainer",
    "remote.endpoints",
    "remote.frameworks",
    "remote.verl_checkpoint_engine",
    "slime_sync",
}
