"""Tie the borrowed experts' gradients to Megatron's gradient synchronisation (both loops).

Megatron runs all but the last micro-batch of an iteration under ``config.no_sync_func`` (the
model chunks' ``no_sync``) and reduces gradients in ``config.finalize_model_grads_func``. Wrapped:
- no_sync also enters ``runtime.accumulating()``: borrowed copies' gradients accumulate locally and
  return to their owners once, from the first backward outside it (the last micro-batch);
- that backward returns them blocking, through autograd (what the cost model prices), or with
  --hybridep-async-grad-return only launches them (overlapping the rest of the backward pass);
- with --overlap-grad-reduce the experts' DDP buckets are reduced from inside that backward: each
  expert bucket group's start_grad_sync first collects the returns launched so far into the
  owners' main grads (every owner parameter's grad hook runs after its layer's gather node, which
  launched its return, so a bucket that is ready has all its returns launched);
- with --overlap-param-gather the distributed optimizer's step no longer all-gathers parameters
  (the next forward's pre-hooks wait for them, module by module), but the runtime reads the owners'
  expert parameters for the next gathers right after the step: it first finishes the all-gather
  of the expert buckets (``runtime.expert_param_sync``); dense buckets keep Megatron's overlap;
- under PP Megatron's train() (and the CPU loop) hands the schedule ``grad_sync_func``, which starts
  a chunk's reduction after its last backward; later stages run that backward under no_sync, so
  the wrapped grad_sync_func returns the chunk's owed gradients first;
- finalize first collects the returns in flight (and whatever a schedule left owed: interleaved
  chunks whose last backward ran under another chunk's no_sync) into the owners' main grads, then
  times Megatron's finalize as the dense gradient reduction.
Megatron sets no_sync_func only with --overlap-grad-reduce; without it DDP's no_sync only marks the
micro-batch, so installing it is harmless. Checked against megatron-core 0.19.2 (schedules.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from megatron_hybridep.megatron import measure
from megatron_hybridep.plan.phases import Phase

DENSE_PHASE = Phase.DENSE_GRAD_ALLREDUCE


def _wrap_no_sync(inner: Callable[[], Any] | None, runtime: Any) -> Callable[[], Any]:
    @contextlib.contextmanager
    def no_sync() -> Any:
        with contextlib.ExitStack() as stack:
            if inner is not None:
                stack.enter_context(inner())
            stack.enter_context(runtime.accumulating())
            yield

    no_sync._hybridep = True  # type: ignore[attr-defined]
    return no_sync


def _wrap_finalize(inner: Callable[..., Any], runtime: Any) -> Callable[..., Any]:
    def finalize(*args: Any, **kwargs: Any) -> Any:
        runtime.collect_grad_returns()  # launched in the backward: not owed late, only in flight
        left = runtime.flush_owed_grads()
        if left and any(getattr(getattr(m, "ddp_config", None), "overlap_grad_reduce", False)
                        for m in (args[0] if args else kwargs.get("model", []))):
            raise RuntimeError("hybridep: borrowed gradients were still owed when gradients were already being "
                               "reduced (--overlap-grad-reduce with this schedule); fix: drop "
                               "--overlap-grad-reduce or use --hybridep-borrowed-copies microbatch")
        with runtime.stats.timed(DENSE_PHASE):  # the scheduler takes it out of measured compute
            out = inner(*args, **kwargs)
        measure.count_grad_reductions(args[0] if args else kwargs.get("model", []))
        return out

    finalize._hybridep = True  # type: ignore[attr-defined]
    return finalize


def _wrap_grad_sync(inner: Callable[..., Any], runtime: Any, chunk: Any) -> Callable[..., Any]:
    """Megatron's grad_sync_func (set by its train() under PP with --overlap-grad-reduce): the
    schedule calls it for a chunk once that chunk's backward is over, to start its reduction. Later
    pipeline stages run that last backward under no_sync, so the chunk's borrowed gradients are
    still owed then: return them first (every rank of a stage calls it at the same point)."""
    def grad_sync(*args: Any, **kwargs: Any) -> Any:
        runtime.collect_grad_returns()
        runtime.flush_owed_grads(within=chunk)
        return inner(*args, **kwargs)

    grad_sync._hybridep = True  # type: ignore[attr-defined]
    return grad_sync


def _counting(inner: Callable[..., Any]) -> Callable[..., Any]:
    """finalize for jobs without a runtime (alltoall EP): their reductions counted like hybridep's."""
    def finalize(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        measure.count_grad_reductions(args[0] if args else kwargs.get("model", []))
        return out

    finalize._hybridep = True  # type: ignore[attr-defined]
    return finalize


def install(config: Any, model_chunks: Sequence[Any], runtime: Any) -> None:
    """Point ``config.no_sync_func`` / ``finalize_model_grads_func`` at the wrapped versions
    (idempotent). Without a runtime (alltoall jobs) only Megatron's defaults are set."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    current = config.no_sync_func
    if current is None:
        current = [m.no_sync for m in model_chunks]
        current = current[0] if len(current) == 1 else current
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    if runtime is None:
        config.no_sync_func = current
        if not getattr(config.finalize_model_grads_func, "_hybridep", False):
            config.finalize_model_grads_func = _counting(config.finalize_model_grads_func)
        return
    runtime.async_grad_return = runtime.migration.async_return
    if runtime.async_grad_return:
        for chunk in model_chunks:
            if getattr(getattr(chunk, "ddp_config", None), "overlap_grad_reduce", False):
                _collect_before_reduction(chunk, runtime)
    runtime.expert_param_sync = _expert_param_sync(model_chunks)
    sync = getattr(config, "grad_sync_func", None)
    if isinstance(sync, list):
        config.grad_sync_func = [f if getattr(f, "_hybridep", False) else _wrap_grad_sync(f, runtime, c)
                                 for f, c in zip(sync, model_chunks, strict=True)]
    elif sync is not None and not getattr(sync, "_hybridep", False):
        config.grad_sync_func = _wrap_grad_sync(sync, runtime, model_chunks[0])
    if isinstance(current, list):
        config.no_sync_func = [f if getattr(f, "_hybridep", False) else _wrap_no_sync(f, runtime) for f in current]
    elif not getattr(current, "_hybridep", False):
        config.no_sync_func = _wrap_no_sync(current, runtime)
    if not getattr(config.finalize_model_grads_func, "_hybridep", False):
        config.finalize_model_grads_func = _wrap_finalize(config.finalize_model_grads_func, runtime)


def _collect_before_reduction(chunk: Any, runtime: Any) -> None:
    """Overlapped DDP reduces a bucket from the grad hook of its last parameter: the launched returns
    must be in the owners' main grads before that (it scales and reduces them). Not at the owners'
    own grad hooks: autograd runs those right after the gather node's backward that launched the
    return, so waiting there would block; a bucket becomes ready later, after its other layers'
    backward (and in the first iteration, Megatron starts it from finalize). Owners' expert
    parameters live in the expert-parallel buckets (allreduce=False); dense buckets need nothing."""
    for group in getattr(chunk, "expert_parallel_bucket_groups", ()):
        inner = group.start_grad_sync
        if getattr(inner, "_hybridep", False):
            continue

        def start_grad_sync(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            runtime.collect_grad_returns()
            return _inner(*args, **kwargs)

        start_grad_sync._hybridep = True  # type: ignore[attr-defined]
        group.start_grad_sync = start_grad_sync


def _expert_param_sync(chunks: Sequence[Any]) -> Callable[[], None] | None:
    """Finish the expert buckets' parameter all-gather now (dispatching it if the forward has not),
    in the same order on every rank; the forward pre-hooks then find it done. None without
    --overlap-param-gather (the optimizer's step gathers them itself)."""
    groups = [g for c in chunks if getattr(getattr(c, "ddp_config", None), "overlap_param_gather", False)
              for g in getattr(c, "expert_parallel_bucket_groups", ())]
    if not groups:
        return None

    def sync() -> None:
        for group in groups:
            group.finish_param_sync(skip_next_bucket_dispatch=True)

    return sync


def time_megatron_finalize(config: Any, on_seconds: Callable[[float], None]) -> None:
    """Time Megatron's own finalize_model_grads (dense and expert-data-parallel all-reduces) as the
    schedule calls it, for the bench's per-phase timings: call before ``install``, which wraps it
    (hybridep's owed borrowed-gradient returns then run outside the timed part)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return finalize_model_grads(*args, **kwargs)
        finally:
            on_seconds(time.perf_counter() - t0)

    config.finalize_model_grads_func = timed
