"""A simulated timeline as Chrome trace / Perfetto JSON: one track per chiplet, LPDDR channel and link.

Open `trace.json` in https://ui.perfetto.dev or chrome://tracing. Times are microseconds, rounded
to picoseconds so the file is the same on every machine for the same plan.
"""

from __future__ import annotations

from typing import Any

from aviatorc.schedule.simulate import Timeline


def chrome_trace(timeline: Timeline, *, name: str = "decode step") -> dict[str, Any]:
    tracks = sorted({s.track for s in timeline.spans}, key=_track_order)
    tid = {track: i for i, track in enumerate(tracks)}
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": name}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid[t], "args": {"name": t}} for t in tracks]
    events += [{"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid[t], "args": {"sort_index": tid[t]}}
               for t in tracks]
    for s in sorted(timeline.spans, key=lambda s: (tid[s.track], s.start_s, s.end_s, s.name)):
        events.append({"ph": "X", "pid": 0, "tid": tid[s.track], "name": s.name, "cat": s.kind,
                       "ts": round(s.start_s * 1e6, 6), "dur": round((s.end_s - s.start_s) * 1e6, 6)})
    for chiplet, samples in sorted(timeline.sram_samples.items()):
        for time_s, nbytes in samples:
            events.append({"ph": "C", "pid": 0, "name": f"SRAM chiplet {chiplet}", "ts": round(time_s * 1e6, 6),
                           "args": {"bytes": nbytes}})
    return {"displayTimeUnit": "ns", "traceEvents": events}


def _track_order(track: str) -> tuple[int, int, str]:
    kind, _, rest = track.partition(" ")
    number = rest.rsplit(" ", 1)[-1]
    return ({"chiplet": 0, "lpddr": 1, "link": 2}.get(kind, 3), int(number) if number.isdigit() else 0, track)
