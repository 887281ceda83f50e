"""The rendezvous' answers as a callback POST carries them (`mopar.runtime.rendezvous.answer_of`)."""

from __future__ import annotations

import json

import pytest

from mopar.runtime.rendezvous import answer_of


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview], ids=lambda w: w.__name__)
def test_a_failure_posted_to_the_callback_keeps_its_error_whatever_buffer_holds_the_body(wrap):
    # `read_body` hands a body waitress did not buffer in a BytesIO over as a memoryview
    body = wrap(json.dumps({"error": "slice s1 ran out of memory"}).encode())
    answer = answer_of({"x-mopar-status": "507"}, body)
    assert (answer.status, answer.error, answer.frame) == (507, "slice s1 ran out of memory", b"")


def test_a_frame_posted_to_the_callback_is_the_answer():
    answer = answer_of({"x-mopar-timing": "s0=1.000"}, memoryview(b"frame bytes"))
    assert (answer.status, answer.frame, answer.timing) == (200, b"frame bytes", "s0=1.000")
