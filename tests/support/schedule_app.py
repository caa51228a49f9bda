"""schedule_app: a materialiser process for the schedule acceptance tests.

``python -m tests.support.schedule_app URL STOP_FILE`` calls `materialize_schedules` in a loop
against URL until STOP_FILE exists: prints ``ready`` once connected, and at the end how many
tasks it created, and exits 0.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from sqlalchemy import create_engine

from sqlalchemy_pgtask.schedule import materialize_schedules


def main(url: str, stop: Path) -> int:
    engine = create_engine(url, pool_size=1, max_overflow=0)
    created = 0
    try:
        created += materialize_schedules(engine, limit=1).created  # connected: ready
        print("ready", flush=True)
        while not stop.exists():
            report = materialize_schedules(engine, limit=10)
            created += report.created
            if report.selected == 0:
                time.sleep(0.05)  # idle: the test moves database time meanwhile
    finally:
        engine.dispose()
    print(created, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
