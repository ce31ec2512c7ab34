"""update_browse_history survives Chromium's start: OSWorld's task 44ee5668 ("clear the YouTube
history") gave the noop agent free points while the entries vanished (Chromium razes a History
database it did not make)."""

from __future__ import annotations

from pathlib import Path

from osfarm.env import SyncTaskEnv
from osfarm.farm.server import FarmServer
from osfarm.tasks.model import load_task

TASK = Path(__file__).resolve().parents[2] / "shared" / "osworld" / "examples" / "chrome" / \
    "44ee5668-ecd5-4366-a6ce-c1c9b8d4e938.json"
COUNT = ("import sqlite3; db = sqlite3.connect('file:/home/user/.config/google-chrome/Default/History?mode=ro', "
         "uri=True); print(db.execute(\"SELECT count(*) FROM urls WHERE url LIKE '%youtube%'\").fetchone()[0])")
DELETE_YOUTUBE = ("import sqlite3; db = sqlite3.connect('/home/user/.config/google-chrome/Default/History'); "
                  "db.execute(\"DELETE FROM urls WHERE url LIKE '%youtube%'\"); db.commit()")


def test_history_entries_survive_chromium_and_noop_gets_nothing(farm: FarmServer, tmp_path: Path) -> None:
    task = load_task(TASK)
    n_youtube = sum("youtube" in h["url"] for h in task.config[0].parameters["history"])
    with SyncTaskEnv(farm.url, farm.token, work_dir=tmp_path / "noop") as env:
        env.reset(task)  # history written, then Chromium launched on that profile
        env.step("import time; time.sleep(3)")  # Chromium has had time to open (and formerly raze) it
        out = env.step(f"import subprocess; print(subprocess.run(['python3', '-c', {COUNT!r}], "
                       "capture_output=True, text=True).stdout)")[4]
        assert out["results"][0]["output"].strip() == str(n_youtube), out
        _obs, reward, terminated, _t, _i = env.step("DONE")
        assert terminated and reward == 0.0
    # and the check can be passed: close Chromium, delete the YouTube rows, DONE
    with SyncTaskEnv(farm.url, farm.token, work_dir=tmp_path / "solve") as env:
        env.reset(task)
        env.step(["import subprocess, time; subprocess.run(['pkill', '-f', 'chromium']); time.sleep(2)",
                  f"import subprocess; subprocess.run(['python3', '-c', {DELETE_YOUTUBE!r}], check=True)"])
        _obs, reward, terminated, _t, _i = env.step("DONE")
        assert terminated and reward == 1.0
