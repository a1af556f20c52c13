"""Run as a script by ``test_no_leaks.py``: a TP-2 engine takes updates on a few channels,
generates, shuts down; the trainer side closes its channels. Everything a run leaves
(multiprocessing's resource-tracker warnings) shows on this process's stderr at exit."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent / "support", HERE.parent / "e2e", HERE):
    sys.path.insert(0, str(folder))

from engine import configure_cpu_env  # noqa: E402

configure_cpu_env()


def main(model_root: str) -> None:
    from faults import TP, full_shards, generate, running_engine, update
    from update_cases import new_weights

    from sglang.srt.weight_sync.protocol import make_channel

    with running_engine(Path(model_root)) as (eng, model_dir, _):
        for i in range(3):  # three channels, as three trainer groups would have
            success, message, _ = update(
                eng,
                make_channel(),
                f"leak-{i}",
                [full_shards(new_weights(model_dir, i + 1))] * TP,
                timeout_s=60,
            )
            assert success, message
        assert len(generate(eng, [[5, 17, 42, 7]])[0]) == 4
    print("LEAK-RUN-DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
