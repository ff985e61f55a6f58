"""The inter-DC byte counter sees pipeline sends (issue 25: PP = 2 across 2 DCs printed "0 B").
cpu_demo on 2 DCs x 2 ranks with one stage per DC: every activation sent forward and every
activation gradient sent back crosses the DC boundary."""

from megatron_hybridep.train.launch import run_ranks

ITERS = 2


def _run(ctx):
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train import cpu_loop
    from tests.matrix.harness import PRESET

    args = parse(["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--train-iters",
                  str(ITERS), "--lr-warmup-iters", "1", "--hybridep-nproc", "4"], default_config=PRESET)
    summary = cpu_loop.run(args)
    return summary.inter_dc_by_phase, (args.seq_length, args.micro_batch_size, args.hidden_size,
                                       args.global_batch_size)


def test_pipeline_sends_between_dcs_are_counted():
    by_phase, (seq, mbs, hidden, gbs) = run_ranks(_run, 4, timeout=300)[0]
    dp = 4 // 2
    micro_batches = gbs // (mbs * dp)
    send = seq * mbs * hidden * 4  # one [seq, micro-batch, hidden] fp32 activation (or its gradient)
    # each of a stage's 2 ranks: M sends forward (stage 0) and M back (stage 1), every iteration
    assert by_phase["pipeline_send"] == ITERS * 2 * 2 * micro_batches * send
