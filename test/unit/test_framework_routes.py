"""What the routes of slime's own SGLang build answer on this wheel
(``weight_sync.framework_routes``), for each body slime's ``SGLangEngine`` sends and for bodies
it never sends. The routes themselves are served in ``test/e2e/test_slime_paths.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang.srt.weight_sync.framework_routes import (
    post_process_weights_reply,
    pull_weights_reply,
    weight_version_reply,
)


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize("restore,repack", [(True, False), (False, True), (True, True)])
def test_post_process_on_an_unquantized_model_has_nothing_to_do(restore, repack):
    reply = post_process_weights_reply(
        body(restore_weights_before_load=restore, post_process_quantization=repack),
        None,
    )
    assert reply.status == 200 and reply.body["success"], reply
    assert "not quantized" in reply.body["message"]


def test_post_process_asking_nothing_succeeds_on_any_model():
    for quantization in (None, "compressed-tensors"):
        reply = post_process_weights_reply(body(), quantization)
        assert reply.status == 200 and reply.body["success"], reply


def test_post_process_on_a_quantized_model_is_refused_naming_it():
    reply = post_process_weights_reply(
        body(restore_weights_before_load=True, post_process_quantization=False),
        "compressed-tensors",
    )
    assert reply.status == 501 and not reply.body["success"]
    assert "'compressed-tensors'" in reply.body["message"]
    assert "restore_weights_before_load" in reply.body["message"]


@pytest.mark.parametrize(
    "raw,named",
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "got list"),
        (
            body(restore_weights_before_load="yes"),
            "not booleans ['restore_weights_before_load']",
        ),
        (body(repack=True), "unknown fields ['repack']"),
    ],
)
def test_post_process_refuses_a_body_slime_never_sends(raw, named):
    reply = post_process_weights_reply(raw, None)
    assert reply.status == 400 and not reply.body["success"]
    assert named in reply.body["message"], reply.body["message"]


def test_pull_weights_is_refused_naming_the_alternatives():
    reply = pull_weights_reply()
    assert reply.status == 501 and not reply.body["success"]
    for route in (
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/join_weight_sync_group",
    ):
        assert route in reply.body["message"], route


def test_weight_version_as_each_release_keeps_it():
    older = SimpleNamespace(server_args=SimpleNamespace(weight_version="7"))
    assert weight_version_reply(older).body == {"weight_version": "7"}
    newer = SimpleNamespace(config_value={"weight_version": "8"}.get)
    assert weight_version_reply(newer).body == {"weight_version": "8"}
