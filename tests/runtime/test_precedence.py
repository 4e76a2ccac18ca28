"""`Session.precedence`: a step in flight on another thread pauses while one thread goes first.

- a decode step started while the main thread holds precedence does not finish (a tiny model's
  step takes milliseconds; it is still running after a second), the main thread's own prefill
  runs to its end meanwhile (no deadlock), and once precedence is released the paused step
  finishes with the logits of the same step run without any pause (exact: same arithmetic);
- nested and concurrent holders: a checkpoint waits until every other holder is done.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from aviatorc.backends.contract import Precedence

import aviatorc
from aviatorc import zoo
from aviatorc.runtime import Session


@pytest.fixture(scope="module")
def artifact():
    model = zoo.build_model("llama").inner.eval()
    return aviatorc.compile(model, target="mock", context=32, prompt=8, batch=2, time_limit_s=1.0)


def test_decode_in_flight_pauses_while_a_prefill_goes_first(artifact):
    prompt = zoo.example_inputs("llama", seed=0)["input_ids"][0].numpy()[:6]
    other = zoo.example_inputs("llama", seed=1)["input_ids"][0].numpy()[:4]
    reference = Session(artifact)
    token = int(np.argmax(reference.prefill(0, prompt)))
    expected = reference.decode([0], [token])

    session = Session(artifact)
    session.prefill(0, prompt)
    got: list[np.ndarray] = []
    with session.precedence.first():
        step = threading.Thread(target=lambda: got.append(session.decode([0], [token])))
        step.start()
        step.join(timeout=1.0)
        assert step.is_alive(), "the decode step ran to its end while another thread held precedence"
        first = session.prefill(1, other)  # the holder's own work is not paused
    step.join(timeout=30)
    assert not step.is_alive()
    np.testing.assert_array_equal(got[0], expected)
    np.testing.assert_array_equal(first, Session(artifact).prefill(0, other))


def test_checkpoint_waits_for_every_other_holder():
    precedence = Precedence()
    passed = threading.Event()

    def waiter() -> None:
        precedence.checkpoint()
        passed.set()

    outer, inner = threading.Event(), threading.Event()

    def second_holder() -> None:
        with precedence.first():
            outer.set()
            inner.wait()

    holder = threading.Thread(target=second_holder)
    with precedence.first():
        with precedence.first():  # nested in one thread
            holder.start()
            outer.wait()
            thread = threading.Thread(target=waiter)
            thread.start()
        precedence.checkpoint()  # a holder's own checkpoint returns
        assert not passed.wait(0.2)
    assert not passed.wait(0.2), "passed while the second thread still held precedence"
    inner.set()
    holder.join()
    assert passed.wait(5)
    thread.join()
    assert not precedence.held
