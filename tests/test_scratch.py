"""A worker's scratch folder (packing/scratch.py): a task's files are its own while it lives, and a
dead task's are swept by the next one, never a live one's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from shardkit.packing.scratch import locked_stem, sweep

# A task in another process that takes its stem, writes a shard there, says so, then waits.
_TASK = """
import sys, time
from pathlib import Path
from shardkit.packing.scratch import locked_stem
with locked_stem(Path(sys.argv[1]), "shard-000007.tar") as stem:
    Path(f"{stem}.tmp").write_bytes(b"half a shard")
    print(stem, flush=True)
    time.sleep(60)
"""


def test_a_live_tasks_files_stay_and_a_dead_tasks_are_swept(tmp_path: Path) -> None:
    task = subprocess.Popen([sys.executable, "-c", _TASK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        stem = task.stdout.readline().strip()
        assert stem, "the task did not start"
        sweep(tmp_path)
        assert Path(f"{stem}.tmp").exists()  # its owner lives: kept
        with locked_stem(tmp_path, "shard-000008.tar") as mine:  # (and a task beside it has its own)
            Path(f"{mine}.tmp").write_bytes(b"mine")
            os.kill(task.pid, signal.SIGKILL)  # killed mid-shard: it cannot clean up
            task.wait()
            assert Path(f"{stem}.tmp").exists()
            sweep(tmp_path)
            assert not any(path.name.startswith("shard-000007") for path in tmp_path.iterdir())
            assert Path(f"{mine}.tmp").exists()  # a live task's files survive any sweep
        assert list(tmp_path.iterdir()) == []  # and a task that ends removes its own
    finally:
        task.kill()
        task.wait()
