"""One bad item fails alone: a batch that raises is run again one request at a time, and only the requests that
raise again get an error (unless the model is not safe to run twice)."""

from __future__ import annotations

import numpy as np
from conftest import pipeline_held, wait_for
from wire import RawPeer

PICKY = {"inputs": [{"dtype": "float32", "shape": [2]}], "max_batch_size": 8, "warmup_batch_sizes": [1],
         "max_wait_ms": 0}


def replies_of_one_batch(daemon, gates, model: str, rows: list[list[float]]) -> dict[int, dict]:
    """Send one request per row while the daemon's one executor is held, so that they all wait and then go
    as one batch; each reply's header by request id."""
    with RawPeer(daemon.endpoint) as peer:
        def held(gate, full):
            peer.send(f"gate{gate.number}", model, [np.array([[-gate.number, 0]] * (8 if full else 1), np.float32)],
                      timeout_ms=60_000)
        with pipeline_held(daemon, gates, held):
            for index, row in enumerate(rows):
                peer.send(index, model, [np.array([row], np.float32)], timeout_ms=60_000)
            wait_for(lambda: daemon.status()["models"][model]["queue_depth"] == len(rows), what="all queued")
        replies = {}
        while len(replies) < len(rows):
            header, outputs = peer.recv(timeout=30)
            if isinstance(header["id"], int):
                replies[header["id"]] = {**header, "outputs": outputs}
        assert peer.nothing_more()
    return replies


def test_one_raising_request_of_a_batch_fails_alone_and_the_others_get_their_answers(start_daemon, gates, repo):
    daemon = start_daemon({"picky": PICKY, "picky_once": {**PICKY, "retry_lost_batches": False,
                                                          "repository": str(repo / "picky")}},
                          workers={"streams": 1})
    rows = [[1, 1], [2, 2], [3, -3], [4, 4], [5, 5]]
    before = daemon.call("stats")["models"]["picky"]["batch_size"]["distribution"]
    replies = replies_of_one_batch(daemon, gates, "picky", rows)
    after = daemon.call("stats")["models"]["picky"]["batch_size"]["distribution"]
    assert after.get("5", 0) == before.get("5", 0) + 1, "the five requests went as one batch"
    for index, row in enumerate(rows):
        reply = replies[index]
        if row[1] < 0:
            assert reply["status"] == "internal", reply
            assert reply["error"] == "picky v1: RuntimeError: a negative second value is refused by the model"
            assert reply["version"] == "v1"
        else:
            assert reply["status"] == "ok", reply
            np.testing.assert_array_equal(reply["outputs"][0], np.array([row], np.float32) * 3)
    assert "running each request alone" in daemon.log()

    # A model not safe to run twice: its raising batch fails every request in it, as before.
    replies = replies_of_one_batch(daemon, gates, "picky_once", rows)
    assert {reply["status"] for reply in replies.values()} == {"internal"}
    assert all("a negative second value" in reply["error"] for reply in replies.values())
