"""On GPU, pretrain_moe.py runs Megatron's own loop; the runtime must still hear about every
optimizer step (shared-expert rule, layer-0 encode and prefetch). The hook wraps Megatron's
train_step by name, once; the runtime's post-step it owes runs at the start of the next train_step
(or evaluation), so that a checkpoint saved in between sees nothing in flight."""

import pytest


def test_megatron_train_step_is_wrapped_once_and_calls_the_runtime(monkeypatch):
    training = pytest.importorskip("megatron.training.training")
    from megatron_hybridep.megatron import training_hooks
    from megatron_hybridep.runtime import context

    calls = []

    class Stats:
        def reset(self) -> None:
            calls.append("reset")

    class Runtime:
        scheduler, step, stats, post_step_due, boundary = None, 0, Stats(), False, None

        def after_optimizer_step(self) -> None:
            calls.append("runtime")

    def fake_train_step(*args, **kwargs):
        calls.append("megatron")
        return ("loss", args, kwargs)

    monkeypatch.setattr(training, "train_step", fake_train_step)
    monkeypatch.setattr(training, "evaluate", training.evaluate)
    monkeypatch.setattr(context.process_context(), "runtime", Runtime())
    training_hooks.after_each_step()
    training_hooks.after_each_step()  # idempotent: a second pretrain() in-process must not double-step
    assert training.train_step(1, k=2) == ("loss", (1,), {"k": 2})
    assert calls == ["megatron", "reset"]  # the post-step is owed: a save here sees nothing in flight
    training.train_step()
    assert calls == ["megatron", "reset", "runtime", "megatron", "reset"]
    monkeypatch.setattr(context.process_context(), "runtime", None)
    training.train_step()
    assert calls == ["megatron", "reset", "runtime", "megatron", "reset", "megatron"]


def test_an_evaluation_runs_the_owed_post_step_and_keeps_the_state_a_save_must_see(monkeypatch):
    """train() evaluates between a step and its save: the evaluation's forward needs the post-step,
    the save the state before it (a copy: the post-step changes the codec's tensors in place)."""
    import torch

    training = pytest.importorskip("megatron.training.training")
    from megatron_hybridep.megatron import training_hooks
    from megatron_hybridep.runtime import context

    calls = []

    class Runtime:
        scheduler, step, post_step_due, boundary = None, 0, True, None
        held = torch.zeros(2)

        def state_dict(self):
            return {"held": self.held}

        def after_optimizer_step(self) -> None:
            self.held.add_(1)
            calls.append("runtime")

    monkeypatch.setattr(training, "train_step", lambda *a, **k: None)
    monkeypatch.setattr(training, "evaluate", lambda *a, **k: calls.append("evaluate"))
    runtime = Runtime()
    monkeypatch.setattr(context.process_context(), "runtime", runtime)
    training_hooks.after_each_step()
    training.evaluate()
    training.evaluate()  # nothing owed any more
    assert calls == ["runtime", "evaluate", "evaluate"]
    assert runtime.boundary["held"].tolist() == [0.0, 0.0] and runtime.held.tolist() == [1.0, 1.0]


def test_megatron_own_reparse_accepts_the_hybridep_dispatcher(monkeypatch):
    """pretrain() re-parses sys.argv with Megatron's bare parser (fault-tolerance setup)."""
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_hybridep.megatron import training_hooks

    monkeypatch.setattr(arguments, "add_megatron_arguments", arguments.add_megatron_arguments)
    monkeypatch.setattr("sys.argv", ["pretrain_moe.py", "--moe-token-dispatcher-type", "hybridep",
                                     "--hybridep-plan", "ep"])
    with pytest.raises(SystemExit):
        arguments.parse_args(ignore_unknown_args=True)
    training_hooks.hybridep_in_every_parser()
    training_hooks.hybridep_in_every_parser()
    assert arguments.parse_args(ignore_unknown_args=True).moe_token_dispatcher_type == "hybridep"


def test_the_wrapped_step_runs_the_scheduler_before_the_runtime_learns_the_step(monkeypatch):
    """--hybridep-replan-interval on GPU: the runtime's scheduler decides after every optimizer step,
    before the next iteration's first gather is started by after_optimizer_step."""
    training = pytest.importorskip("megatron.training.training")
    from megatron_hybridep.megatron import training_hooks
    from megatron_hybridep.runtime import context

    calls = []

    class Scheduler:
        def step(self, iteration):
            calls.append(("scheduler", iteration))
            return None

    class Stats:
        def reset(self) -> None:
            calls.append("reset")

    class Runtime:
        scheduler, step, stats, post_step_due, boundary = Scheduler(), 0, Stats(), False, None

        def after_optimizer_step(self) -> None:
            self.step += 1
            calls.append("runtime")

    monkeypatch.setattr(training, "train_step", lambda *a, **k: calls.append("megatron"))
    monkeypatch.setattr(training, "evaluate", training.evaluate)
    monkeypatch.setattr(context.process_context(), "runtime", Runtime())
    training_hooks.after_each_step()
    training.train_step()
    training.train_step()
    assert calls == ["megatron", ("scheduler", 1), "reset", "runtime", "megatron", ("scheduler", 2), "reset"]
