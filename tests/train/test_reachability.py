"""The peer probe behind the one-line error of a failed collective (train/reachability.py)."""

import socket

from megatron_hybridep.train import reachability as R


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


def test_a_peer_still_exiting_after_its_reset_is_probed_again(monkeypatch):
    """A killed peer whose beacon drops the first handshake while it exits: the settled probe finds it gone."""
    keep: list = []
    peer = R.Peer(1, 1, "127.0.0.1", _silent_port(keep))

    def exits(_s: float) -> None:  # the peer finishes exiting during the settle: its sockets close
        for k in keep:
            k.close()

    monkeypatch.setattr(R.time, "sleep", exits)
    try:
        assert R.probe([peer], timeout_s=0.5) == {1: R.UNREACHABLE}  # no settle: the first verdict stands
        assert R.probe([peer], timeout_s=0.5, settle_s=0.5) == {1: R.GONE}
    finally:
        for k in keep:
            k.close()


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


def test_a_beacon_with_status_replies_with_the_ranks_progress():
    beacon = R.Beacon("127.0.0.1", status=lambda: "41 12 3.5 forward-backward")
    mute = R.Beacon("127.0.0.1")  # accepts handshakes, never replies: a stopped process's beacon
    try:
        progress: dict = {}
        status = R.probe([R.Peer(1, 0, "127.0.0.1", beacon.port, answers=True),
                          R.Peer(2, 1, "127.0.0.1", mute.port, answers=True)], timeout_s=0.5, progress=progress)
    finally:
        beacon.close()
        mute.close()
    assert status == {1: R.REACHABLE, 2: R.STOPPED}
    assert progress == {1: R.Progress(41, 12, 3.5, "forward-backward")}


def _stopped_child(port_file):
    import os
    import time

    from megatron_hybridep.train import reachability

    beacon = reachability.Beacon("127.0.0.1", status=lambda: "7 3 0.0 end of iteration")
    with open(port_file + ".tmp", "w") as f:
        f.write(str(beacon.port))
    os.rename(port_file + ".tmp", port_file)
    time.sleep(120)  # killed by the test long before


def test_a_stopped_process_is_told_apart_from_a_live_one(tmp_path):
    import multiprocessing as mp
    import os
    import signal
    import time

    port_file = str(tmp_path / "port")
    child = mp.get_context("spawn").Process(target=_stopped_child, args=(port_file,), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            assert time.monotonic() < deadline and child.is_alive(), "the child never opened its beacon"
            time.sleep(0.05)
        peer = R.Peer(1, None, "127.0.0.1", int(open(port_file).read()), answers=True)
        assert R.probe([peer], timeout_s=2.0) == {1: R.REACHABLE}
        os.kill(child.pid, signal.SIGSTOP)
        # kill() returns before the child has stopped; on a loaded machine its beacon could still
        # answer once, so wait until the kernel reports it stopped (state T)
        deadline = time.monotonic() + 30
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the child never stopped"
            time.sleep(0.01)
        assert R.probe([peer], timeout_s=0.5) == {1: R.STOPPED}
        os.kill(child.pid, signal.SIGCONT)
        assert R.probe([peer], timeout_s=2.0) == {1: R.REACHABLE}
    finally:
        child.kill()
        child.join(10)


def test_failure_line_names_the_stalled_peer():
    dcs = {0: 0, 1: 0, 2: 1, 3: 1}
    timeout = RuntimeError("[gloo/pair.cc:1] Timed out waiting 6000ms for recv")
    stopped = R.failure_line(0, 0, 6.0, {1: R.REACHABLE, 2: R.STOPPED, 3: R.REACHABLE}, dcs, timeout)
    assert "stalled peers (reachable, process not answering: stopped?): rank 2 (DC 1)" in stopped
    assert "every peer is reachable" not in stopped
    progress = {1: R.Progress(40, 10, 1.0, "forward-backward"), 2: R.Progress(37, 9, 55.0, "optimizer step"),
                3: R.Progress(40, 10, 1.0, "forward-backward")}
    behind = R.failure_line(0, 0, 6.0, dict.fromkeys((1, 2, 3), R.REACHABLE), dcs, timeout, progress,
                            R.Progress(40, 10, 6.0, "forward-backward"))
    assert "stalled peer: rank 2 (DC 1) is behind, at iteration 9 (optimizer step), no progress for 55 s" in behind
    assert "rank 1" not in behind.split("stalled peer")[1] and "\n" not in behind
    level = {r: R.Progress(40, 10, 1.0, "forward-backward") for r in (1, 2, 3)}
    assert "every peer is reachable" in R.failure_line(0, 0, 6.0, dict.fromkeys((1, 2, 3), R.REACHABLE), dcs,
                                                       timeout, level, R.Progress(40, 10, 6.0, "forward-backward"))
