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

REPO = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PRESET = os.path.join(REPO, "configs", "presets", "cpu_demo.yaml")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*not installed.*")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _args(argv: list[str]):  # noqa: ANN202
    from megatron_hybridep.megatron.arguments import parse

    # No preset and no model on the command line: the built-in CPU demo, with any flags on top.
    defines_model = "--config" in argv or any(a.startswith("--num-layers") for a in argv)
    return parse(argv, default_config=None if defines_model else DEFAULT_PRESET)


def _rank_main(ctx, argv: list[str]):  # noqa: ANN001, ANN202 - run_ranks entry
    from megatron_hybridep.megatron import cpu_loop

    return cpu_loop.run(_args(argv))


def _launched_rank(argv: list[str]) -> int:
    """This process is one rank (torchrun, srun or the testbed set WORLD_SIZE/RANK)."""
    import torch
    import torch.distributed as dist

    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    args = _args(argv)
    if torch.cuda.is_available():
        from megatron_hybridep.megatron.gpu_pretrain import pretrain

        return pretrain(args)
    from megatron_hybridep.megatron import cpu_loop

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo")
    try:
        cpu_loop.run(args)
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    if "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ:
        return _launched_rank(argv)
    from megatron_hybridep.runtime.launch import run_ranks

    args = _args(argv)  # parse once here: bad flags fail before any process starts
    nproc = args.hybridep_nproc
    print(f"[pretrain_moe] launching {nproc} local CPU ranks (gloo) with "
          f"{args.config or 'command-line flags'}; inter-DC links are NOT shaped (loopback) — "
          "use 'hybridep bench' / the testbed for emulated WAN links", flush=True)
    summaries = run_ranks(_rank_main, nproc, argv, timeout=float(os.environ.get("HYBRIDEP_TIMEOUT", 3600)))
    s = summaries[0]
    from megatron_hybridep.megatron.data import corpus, source

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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
