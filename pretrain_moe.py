#!/usr/bin/env python
"""Megatron-Core GPT-MoE pretraining with HybridEP.

    python pretrain_moe.py                              # built-in CPU demo (configs/presets/cpu_demo.yaml)
    python pretrain_moe.py --config configs/presets/X.yaml [any Megatron or --hybridep-* flag]
    torchrun/srun ... pretrain_moe.py <flags>            # one process per rank (GPU: Megatron's own loop)

Switching an existing Megatron job to HybridEP is one flag: --moe-token-dispatcher-type hybridep.
Without torchrun/srun it launches --hybridep-nproc local CPU ranks itself (gloo).
"""

from __future__ import annotations

import os
import sys
import warnings

from megatron_hybridep.runtime.logs import quiet_known_warnings

REPO = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PRESET = os.path.join(REPO, "configs", "presets", "cpu_demo.yaml")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*not installed.*")
warnings.filterwarnings("ignore", message=".*transformer-engine>=1.7.0 supports MoE experts.*")
quiet_known_warnings()  # before Megatron's imports: torch's "No CUDA runtime is found" line among them
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _args(argv: list[str]):  # noqa: ANN202
    from megatron_hybridep.megatron.arguments import parse

    # No preset and no model on the command line: the built-in CPU demo, with any flags on top.
    defines_model = "--config" in argv or any(a.startswith("--num-layers") for a in argv)
    return parse(argv, default_config=None if defines_model else DEFAULT_PRESET)


def _with_layout(argv: list[str], world: int, announce: bool) -> list[str]:
    """--hybridep-layout auto: the layout planner's TP/PP/EP flags appended to ``argv``, unless the
    command line fixes one of them (train/planning.py choose_layout)."""
    args = _args(argv)
    if getattr(args, "hybridep_layout", "off") != "auto":
        return argv

    from megatron_hybridep.train.planning import LAYOUT_FLAGS, choose_layout

    fixed = [f for f in LAYOUT_FLAGS if any(a == f or a.startswith(f + "=") for a in argv)]
    flags, report = choose_layout(args, world, fixed)
    if announce:
        print(report, flush=True)
    return [*argv, *flags, "--hybridep-layout", "off"] if flags else argv


def _rank_main(ctx, argv: list[str]):  # noqa: ANN001, ANN202 - run_ranks entry
    from megatron_hybridep.train import cpu_loop
    from megatron_hybridep.train.preflight import one_line

    args = _args(argv)
    try:
        return cpu_loop.run(args)
    except Exception as e:
        # The parent prints the first rank's last line; make it the one-line form with the flags.
        raise RuntimeError(one_line(e, args)) from e


def _launched_rank(argv: list[str]) -> int:
    """This process is one rank (torchrun, srun or the testbed set WORLD_SIZE/RANK)."""
    import torch
    import torch.distributed as dist

    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    # every rank computes the same layout (a pure function of the flags); rank 0 says which
    args = _args(_with_layout(argv, int(os.environ["WORLD_SIZE"]), announce=os.environ.get("RANK") == "0"))
    from megatron_hybridep.train.planning import ratio_notice

    if os.environ.get("RANK") == "0" and (notice := ratio_notice(args)):
        print(notice, flush=True)
    from megatron_hybridep.train import restart

    try:  # before any collective: the launcher (torchrun, the sbatch loop) restarts ranks, not this process
        restart.check_launched(args)
    except ValueError as e:
        print(f"pretrain_moe.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    if restart.resume_on_restart(args) and os.environ.get("RANK") == "0":
        print(f"[pretrain_moe] restarted by the launcher: resuming from {args.load or 'the start (no checkpoint)'}",
              flush=True)
    if torch.cuda.is_available():
        from megatron_hybridep.train.gpu_pretrain import pretrain

        return pretrain(args)
    from megatron_hybridep.train import cpu_loop

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    # No local launcher to watch progress: torch.distributed's own collective timeout, from the same
    # flag, on every group once the model is built (cpu_loop). Not on the rendezvous: a restarted rank
    # waits there for its peers (and for the network to come back).
    stall = args.hybridep_stall_timeout
    dist.init_process_group("gloo")
    from megatron_hybridep.train import reachability
    from megatron_hybridep.train.launch import progress_status

    # gloo's timeout names no peer: a beacon per rank lets a failed rank say which peers it cannot
    # reach, and which live one is stalled (its beacon replies with its progress)
    try:
        beacon = reachability.Beacon(status=progress_status)
    except OSError:
        beacon = None  # no address to listen on: the error line then names no peer
    dc = int(os.environ["HYBRIDEP_DC"]) if "HYBRIDEP_DC" in os.environ else None
    peers: list = [None] * dist.get_world_size()
    me = reachability.Peer(dist.get_rank(), dc, beacon.host if beacon else "", beacon.port if beacon else 0,
                           answers=beacon is not None)
    dist.all_gather_object(peers, me)
    args.hybridep_collective_timeout = stall  # every group's collectives, not only the world group's
    try:
        cpu_loop.run(args)
    except Exception as e:
        if not reachability.is_comm_failure(e):
            raise
        rank = dist.get_rank()
        progress: dict = {}
        status = reachability.probe([p for p in peers if p.rank != rank and p.port],
                                    settle_s=0 if reachability.is_timeout(e) else 0.5, progress=progress)
        line = reachability.failure_line(rank, dc, stall, status, {p.rank: p.dc for p in peers}, e, progress,
                                         reachability.Progress.parse(progress_status()))
        sys.stdout.flush()
        print(f"pretrain_moe.py: error: {line}", file=sys.stderr, flush=True)
        os._exit(1)  # not destroy_process_group: it may wait on the peers that are gone
    dist.destroy_process_group()
    if beacon:
        beacon.close()
    return 0


def main(argv: list[str], early_forkserver: bool = False) -> int:
    """``early_forkserver`` (a fresh process only): the ranks' fork server imports torch and Megatron
    beside this process's own parsing and checks, not after them (~9 s less before the first step)."""
    if "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ:
        return _launched_rank(argv)
    from megatron_hybridep.train import launch

    if early_forkserver:
        launch.start_forkserver()
    try:
        return _launch_local(argv)
    finally:  # also after bad input or --help, where its preload would otherwise run on for seconds
        if early_forkserver:
            launch.stop_forkserver()


def _launch_local(argv: list[str]) -> int:
    from megatron_hybridep.train import restart
    from megatron_hybridep.train.launch import RankFailure, StallRule
    from megatron_hybridep.train.preflight import internal_line, is_bad_input, one_line, preflight, save_report

    args = None
    try:
        args = _args(argv)  # parse and check here: bad input fails before any process starts
        nproc = args.hybridep_nproc
        if nproc < 1:
            raise ValueError(f"--hybridep-nproc {nproc}: fix: at least 1 rank")
        argv = _with_layout(argv, nproc, announce=True)  # the ranks parse the final flags
        args = _args(argv)
        restart.check_flags(args)
        preflight(args, nproc)
    except SystemExit as e:  # argparse already printed its one-line usage error
        return int(e.code or 0)
    except Exception as e:  # noqa: BLE001 - one line, no traceback on the terminal
        if not is_bad_input(e):  # ours or a library's: where it came from, the traceback in a file
            print(f"pretrain_moe.py: error: {internal_line(e)}", file=sys.stderr)
            return 1
        print(f"pretrain_moe.py: error: {one_line(e, args)}", file=sys.stderr)
        return 2
    from megatron_hybridep.train.planning import ratio_notice

    if notice := ratio_notice(args):
        print(notice, flush=True)
    print(f"[pretrain_moe] launching {nproc} local CPU ranks (gloo) with "
          f"{args.config or 'command-line flags'}; inter-DC links are NOT shaped (loopback) — "
          "use 'hybridep bench' / the testbed for emulated WAN links", flush=True)
    stall = args.hybridep_stall_timeout
    rule = None if stall == 0 else StallRule(fixed=stall)
    try:
        summaries, restarts = restart.run_with_restarts(
            _rank_main, nproc, argv, max_restarts=args.hybridep_max_restarts, save=args.save,
            log=lambda line: print(line, flush=True), timeout=float(os.environ.get("HYBRIDEP_TIMEOUT", 3600)),
            stall=rule, forward_signals=True)
    except RankFailure as e:
        report = save_report(str(e))
        n = getattr(e, "restarts", 0)
        after = (f"; after {n} restart{'s' if n != 1 else ''}" if n else "") + (
            "; not restarted: an error of the run itself, not a fault (a restart would repeat it)"
            if args.hybridep_max_restarts and not getattr(e, "restartable", True) and e.signalled is None else "")
        print(f"pretrain_moe.py: error: {restart.root_cause(e)}{after} (every rank's report: {report})",
              file=sys.stderr)
        return 1
    s = summaries[0]
    from megatron_hybridep.train.data import corpus, source

    print("\n[pretrain_moe] summary")
    print(f"  plan               {s.plan}")
    print(f"  iterations         {s.iterations}")
    print(f"  loss               {s.first_loss:.4f} -> {s.final_loss:.4f}")
    if source(args) == "synthetic":
        c = corpus(args)
        print(f"  corpus entropy     unigram {c.unigram_entropy():.4f}, best achievable {c.conditional_entropy():.4f}"
              " nats/token")
    if s.step_times:
        import statistics

        print(f"  step time          median {statistics.median(s.step_times) * 1e3:.1f} ms; "
              f"{s.tokens_per_s:.0f} tokens/s")
    print(f"  inter-DC traffic   {s.inter_dc_bytes / 1e6:.2f} MB in total")
    print(f"  wall time          {s.wall_s:.1f} s")
    if restarts:
        print(f"  restarts           {restarts} (from the last checkpoint in {args.save})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], early_forkserver=True))
