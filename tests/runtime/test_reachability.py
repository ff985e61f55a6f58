"""The peer probe behind the one-line error of a failed collective (runtime/reachability.py)."""

import socket

from megatron_hybridep.runtime import reachability as R


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens once it is closed


def _silent_port(keep: list) -> int:
    """A port whose SYNs go unanswered, as across a dead link: a listener with a full accept queue."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    keep.append(srv)
    for _ in range(8):  # fill the queue (backlog + 1 on most kernels): then SYNs are dropped
        try:
            keep.append(socket.create_connection(srv.getsockname(), timeout=0.3))
        except TimeoutError:
            return srv.getsockname()[1]
    raise AssertionError("the accept queue never filled")


def test_probe_tells_a_live_peer_a_gone_one_and_an_unreachable_one_apart():
    beacon = R.Beacon("127.0.0.1")
    keep: list = [beacon]
    try:
        peers = [R.Peer(0, 0, "127.0.0.1", beacon.port), R.Peer(1, 0, "127.0.0.1", _closed_port()),
                 R.Peer(2, 1, "127.0.0.1", _silent_port(keep))]
        status = R.probe(peers, timeout_s=0.5)
    finally:
        for k in keep:
            k.close()
    assert status == {0: R.REACHABLE, 1: R.GONE, 2: R.UNREACHABLE}


def test_failure_line_names_the_peers_by_rank_and_dc():
    dcs = {0: 0, 1: 0, 2: 1, 3: 1}
    line = R.failure_line(0, 0, 6.0, {1: R.REACHABLE, 2: R.UNREACHABLE, 3: R.UNREACHABLE}, dcs,
                          RuntimeError("[gloo/pair.cc:1] Timed out waiting 6000ms for recv"))
    assert "\n" not in line
    assert line.startswith("rank 0 (DC 0): a collective did not complete within 6 s (--hybridep-stall-timeout)")
    assert "unreachable peers: ranks 2,3 (DC 1)" in line and "--load" in line
    gone = R.failure_line(2, 1, 6.0, {0: R.GONE, 1: R.REACHABLE, 3: R.REACHABLE}, dcs,
                          RuntimeError("Read error [10.0.0.1]:5: Connection reset by peer"))
    assert "a collective failed (Read error" in gone and "peers whose process is gone: rank 0 (DC 0)" in gone
    assert "every peer is reachable" in R.failure_line(0, None, 6.0, {1: R.REACHABLE}, {1: None})


def test_only_communication_failures_are_recognised():
    assert R.is_comm_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 6000ms for recv"))
    wrapped = ValueError("outer")
    wrapped.__cause__ = RuntimeError("Connection closed by peer [10.77.0.2]:1234")
    assert R.is_comm_failure(wrapped)
    assert not R.is_comm_failure(ValueError("--lr: must be positive"))
