"""`hybridep plan --explain` says why the chosen plan wins, with numbers from the cost model."""

import os

from megatron_hybridep.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_explain_names_the_deciding_phases(capsys):
    rc = main(["plan", "--topology", os.path.join(REPO, "configs/topologies/2dc_x_8.yaml"),
               "--model", os.path.join(REPO, "configs/models/paper-s.yaml"), "--tokens-per-rank", "16384",
               "--explain"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "why domains" in out and "vs plain EP ep (S=1)" in out
    assert "token_a2a_fwd saves" in out and "expert_allgather costs" in out
    assert "x slower" in out and "borrowed expert copies" in out
