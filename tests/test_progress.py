"""Progress through `logging` (issue 10, item 2): a stage's start, updates and end as records
carrying `Progress`; the Python API's `log=` callback still gets its lines; the library never
configures logging."""

from __future__ import annotations

import logging

import pytest

from aviatorc import progress
from aviatorc.progress import is_update, progress_of, stage


def test_a_stage_logs_its_start_updates_and_end(caplog, monkeypatch):
    monkeypatch.setattr(progress, "UPDATES_PER_S", 1e9)
    logger = logging.getLogger("aviatorc.test")
    echoed: list[str] = []
    with caplog.at_level(logging.INFO, logger="aviatorc"), stage(logger, "solving", total=2, echo=echoed.append) as task:
        task.advance(detail="layer 0: best 1.000 us, gap 0.5%")
        task.advance()
        task.finish("2 solved")
    events = [progress_of(r) for r in caplog.records]
    assert [(e.event, e.completed, e.total, e.detail) for e in events if e is not None] == [
        ("start", 0, 2, ""), ("update", 1, 2, "layer 0: best 1.000 us, gap 0.5%"),
        ("update", 2, 2, "layer 0: best 1.000 us, gap 0.5%"), ("end", 2, 2, "layer 0: best 1.000 us, gap 0.5%")]
    assert caplog.records[1].getMessage() == "solving: layer 0: best 1.000 us, gap 0.5%" and is_update(caplog.records[1])
    assert echoed[0] == "solving" and echoed[1].startswith("solving: 2 solved, ") and len(echoed) == 2


def test_updates_are_throttled_but_the_last_one_is_kept(caplog, monkeypatch):
    monkeypatch.setattr(progress, "UPDATES_PER_S", 1e-9)  # at most one update per ~31 years
    logger = logging.getLogger("aviatorc.test")
    with caplog.at_level(logging.INFO, logger="aviatorc"), stage(logger, "sweep", total=3) as task:
        for _ in range(3):
            task.advance()
    updates = [progress_of(r) for r in caplog.records if is_update(r)]
    assert [u.completed for u in updates if u is not None] == [3]  # only the last: the display ends full


def test_a_failed_stage_ends_its_row_and_the_error_propagates(caplog):
    logger = logging.getLogger("aviatorc.test")
    with caplog.at_level(logging.INFO, logger="aviatorc"), pytest.raises(ValueError), stage(logger, "export"):
        raise ValueError("boom")
    assert [(e.event, e.detail) for e in map(progress_of, caplog.records) if e is not None] == [
        ("start", ""), ("end", "failed")]
    assert caplog.records[-1].getMessage() == "export: failed"


def test_compile_hands_its_lines_to_log_and_configures_no_logging(tmp_path):
    import aviatorc
    from tests.test_cli import mlp_onnx

    logger = logging.getLogger("aviatorc")
    before = (logger.level, list(logger.handlers), logging.getLogger().handlers[:])
    path = mlp_onnx(tmp_path / "mlp.onnx")
    lines: list[str] = []
    aviatorc.compile(path, target="mock", log=lines.append)
    assert (logger.level, list(logger.handlers), logging.getLogger().handlers[:]) == before
    assert lines[0] == f"importing {path}" and lines[1].startswith(f"importing {path}: 4 nodes, 2 initializers, ")
    assert "dce: no change in 0.00 s" in lines
    assert lines[-2] == "scheduling decode (batch 1, context 2048) and prefill (prompt 128)"
