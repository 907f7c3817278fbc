"""Rank 0's view of a running `mula prepare`: one bar for the whole job, each rank's rate at the end."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from typing import Any

from mula.data.prepare_summary import read_json

_PROGRESS_POLL_S = 5.0  # rank 0 lists each unfinished source's folder this often for the job's bar
_STATS_RE = re.compile(r"(\d+)\.stats\.json")  # a finished tokenize task's result file


class JobProgress:
    """Rank 0's one bar for the whole job: input bytes of finished tasks (every rank's, read from the
    task results on disk every few seconds), with tokens per second."""

    def __init__(self, todo: list[Any], enabled: bool) -> None:
        from tqdm.auto import tqdm

        self._todo = {(t.out_dir, t.index): t for t in todo}
        self._dirs = sorted({t.out_dir for t in todo})
        self._seen: set[tuple[str, int]] = set()
        self.tokens = 0
        self._start = time.monotonic()
        self._bar = tqdm(
            total=sum(t.input_bytes for t in todo),
            unit="B",
            unit_scale=True,
            desc="prepare",
            disable=not enabled or not todo,
            dynamic_ncols=True,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="mula-prepare-progress", daemon=True)
        if enabled and todo:
            self._thread.start()

    def _poll_loop(self) -> None:
        while not self._stop.wait(_PROGRESS_POLL_S):
            self.poll()

    def poll(self) -> None:
        """Count the tasks that finished since the last poll (one directory listing per source)."""
        for out_dir in self._dirs:
            with contextlib.suppress(OSError):
                for name in os.listdir(out_dir):
                    match = _STATS_RE.fullmatch(name)  # not the temporary name of one being written
                    if match is None:
                        continue
                    key = (out_dir, int(match[1]))
                    if key in self._seen or key not in self._todo:
                        continue
                    result = read_json(os.path.join(out_dir, name))
                    if result is None:
                        continue
                    self._seen.add(key)
                    self.tokens += result["tokens"]
                    self._bar.update(self._todo[key].input_bytes)
        rate = self.tokens / max(time.monotonic() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{self.tokens:,} tokens, {rate:,.0f} tokens/s", refresh=False)

    def close(self) -> None:
        """Stop polling; a last poll shows the final count."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            self.poll()
        self._bar.close()


def format_rates(reports: list[dict[str, Any]]) -> str:
    """One line per rank: tasks, tokens and tokens per second of its share."""
    lines = []
    for r in reports:
        rate = r["tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0
        lines.append(
            f"rank {r['rank']:>4} ({r['host']}): {r['tasks']:>5} tasks {r['tokens']:>15,} tokens"
            f" {rate:>13,.0f} tokens/s"
        )
    return "\n".join(lines)
