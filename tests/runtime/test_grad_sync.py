"""grad_sync.install: Megatron's no_sync also defers borrowed gradients (counted, so interleaved
chunks leaving no_sync out of order still defer), finalize returns what is left owed first, and
both loops install it once (the GPU loop from its train_step wrapper)."""

import contextlib
import types

import pytest

from megatron_hybridep.megatron import grad_sync


class _Runtime:
    def __init__(self):
        from megatron_hybridep.runtime.context import HybridEPRuntime
        from megatron_hybridep.runtime.instrument import Stats

        self.stats, self._no_sync_depth, self.flushed = Stats(), 0, 0
        self.accumulating = types.MethodType(HybridEPRuntime.accumulating, self)  # the real counter
        self.owing = self.collected = 0
        self.migration = types.SimpleNamespace(async_return=True)

    defer_grad_return = property(lambda self: self._no_sync_depth > 0)

    def flush_owed_grads(self, within=None):
        self.flushed += 1
        self.within = within
        return self.owing

    def collect_grad_returns(self):
        self.collected += 1
        return 0


class _BucketGroup:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def start_grad_sync(self, force_all_reduce=False):
        self.log.append(f"reduce {self.name}")


class _Chunk:
    def __init__(self, log, overlap=False):
        self.log, self.ddp_config = log, types.SimpleNamespace(overlap_grad_reduce=overlap)
        self.bucket_groups = [_BucketGroup(log, "dense")]
        self.expert_parallel_bucket_groups = [_BucketGroup(log, "experts")]

    @contextlib.contextmanager
    def no_sync(self):
        self.log.append("enter")
        yield
        self.log.append("exit")


def test_no_sync_defers_and_finalize_flushes_then_times_megatron(monkeypatch):
    log, runtime = [], _Runtime()
    config = types.SimpleNamespace(no_sync_func=None,
                                   finalize_model_grads_func=lambda model, *a, **k: log.append("fin"))
    chunks = [_Chunk(log)]
    grad_sync.install(config, chunks, runtime)
    grad_sync.install(config, chunks, runtime)  # idempotent
    with config.no_sync_func():
        assert runtime.defer_grad_return
    assert not runtime.defer_grad_return and log == ["enter", "exit"]
    config.finalize_model_grads_func(chunks)
    assert runtime.flushed == 1 and log[-1] == "fin"
    assert runtime.stats.seconds_by(phase=grad_sync.DENSE_PHASE) >= 0.0


def test_interleaved_chunks_defer_until_the_last_leaves_no_sync():
    log, runtime = [], _Runtime()
    config = types.SimpleNamespace(no_sync_func=None, finalize_model_grads_func=lambda *a, **k: None)
    chunks = [_Chunk(log), _Chunk(log)]
    grad_sync.install(config, chunks, runtime)
    a, b = (f() for f in config.no_sync_func)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # chunk 0 syncs while chunk 1 still accumulates: keep deferring
    assert runtime.defer_grad_return
    b.__exit__(None, None, None)
    assert not runtime.defer_grad_return


def test_owed_gradients_left_with_overlapped_reduction_are_an_error():
    runtime = _Runtime()
    runtime.owing = 1
    config = types.SimpleNamespace(no_sync_func=None, finalize_model_grads_func=lambda *a, **k: None)
    chunks = [_Chunk([], overlap=True)]
    grad_sync.install(config, chunks, runtime)
    with pytest.raises(RuntimeError, match="overlap-grad-reduce.*fix"):
        config.finalize_model_grads_func(chunks)


def test_gpu_train_step_wrapper_installs_grad_sync(monkeypatch):
    training = pytest.importorskip("megatron.training.training")
    from megatron_hybridep.megatron import training_hooks
    from megatron_hybridep.runtime import context

    runtime = _Runtime()
    runtime.scheduler, runtime.step, runtime.post_step_due, runtime.boundary = None, 0, False, None
    runtime.after_optimizer_step = lambda: None
    seen = {}

    def fake_train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, *rest):
        seen["no_sync"] = config.no_sync_func
        return "ok"

    import megatron.core.num_microbatches_calculator as calculator

    monkeypatch.setattr(training, "train_step", fake_train_step)
    monkeypatch.setattr(context.process_context(), "runtime", runtime)
    monkeypatch.setattr(calculator, "get_num_microbatches", lambda: 6)  # what Megatron's train() configured
    config = types.SimpleNamespace(no_sync_func=None, finalize_model_grads_func=None)
    training_hooks.after_each_step()
    assert training.train_step(None, None, [_Chunk([])], None, None, config, None) == "ok"
    assert runtime.micro_batches == 6  # where --hybridep-early-grad-return splits
    assert getattr(seen["no_sync"], "_hybridep", False)
    assert getattr(config.finalize_model_grads_func, "_hybridep", False)
    assert runtime.async_grad_return  # asked for, and DDP does not overlap its reduction
    assert runtime.post_step_due  # the post-step runs at the start of the next train_step


@pytest.mark.parametrize("asked", [True, False])
def test_overlapped_expert_buckets_collect_launched_returns_before_reducing(asked):
    """--overlap-grad-reduce with --hybridep-async-grad-return: the return stays asynchronous, and an
    expert bucket reduced from a grad hook first collects the returns launched in that backward
    (dense buckets hold no owner's expert parameter: not delayed)."""
    log, runtime = [], _Runtime()
    runtime.migration.async_return = asked
    runtime.collect_grad_returns = lambda: log.append("collect") or 0
    config = types.SimpleNamespace(no_sync_func=None, finalize_model_grads_func=lambda *a, **k: None)
    chunk = _Chunk(log, overlap=True)
    grad_sync.install(config, [chunk], runtime)
    grad_sync.install(config, [chunk], runtime)  # idempotent: one collect per reduction
    assert runtime.async_grad_return == asked
    chunk.bucket_groups[0].start_grad_sync()
    chunk.expert_parallel_bucket_groups[0].start_grad_sync(force_all_reduce=False)
    assert log == (["reduce dense", "collect", "reduce experts"] if asked else ["reduce dense", "reduce experts"])


def test_finalize_collects_launched_returns_before_checking_what_is_owed():
    """Returns in flight at finalize (first iteration: Megatron starts overlapped buckets there) are
    collected, not mistaken for gradients owed too late."""
    runtime = _Runtime()
    seen = []
    runtime.collect_grad_returns = lambda: seen.append("collect") or 1
    runtime.flush_owed_grads = lambda: seen.append("flush") or 0
    config = types.SimpleNamespace(no_sync_func=None, finalize_model_grads_func=lambda *a, **k: seen.append("fin"))
    chunks = [_Chunk([], overlap=True)]
    grad_sync.install(config, chunks, runtime)
    config.finalize_model_grads_func(chunks)
    assert seen == ["collect", "flush", "fin"]


def test_schedule_grad_sync_returns_the_chunks_owed_gradients_first():
    """Under PP Megatron's schedule starts a chunk's reduction through grad_sync_func after its last
    backward, which later stages run under no_sync: that chunk's owed gradients go back first."""
    log, runtime = [], _Runtime()
    runtime.collect_grad_returns = lambda: log.append("collect") or 0
    chunks = [_Chunk(log, overlap=True), _Chunk(log, overlap=True)]
    config = types.SimpleNamespace(no_sync_func=None, finalize_model_grads_func=lambda *a, **k: None,
                                   grad_sync_func=[lambda p, i=i: log.append(f"sync {i}") for i in range(2)])
    grad_sync.install(config, chunks, runtime)
    grad_sync.install(config, chunks, runtime)  # idempotent
    config.grad_sync_func[1]([])
    assert log == ["collect", "sync 1"] and runtime.flushed == 1 and runtime.within is chunks[1]
