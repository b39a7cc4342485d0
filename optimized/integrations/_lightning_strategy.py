"""``ZeroStrategy``: Lightning's DDP strategy with the model trained by a ZeroEngine (imports Lightning; use it
through :mod:`optimized.integrations.lightning`, which reports a missing Lightning by name).

Why DDP's strategy is the base: it already starts the processes (``devices=N`` on one machine, or processes that
torchrun / SLURM started), joins them into a ``torch.distributed`` group (gloo on CPU, NCCL on GPUs), shards the
data with a ``DistributedSampler`` and does the ``barrier`` / ``broadcast`` / ``reduce`` Lightning needs. What
differs is what DDP wraps and what an optimizer step is, so this class replaces exactly those hooks:

- ``setup``: the engine is built over the ``LightningModule`` in place (parameters become views of its flat
  buffer; at stage 3 partitions), with the config :func:`~.lightning_config.resolve_config` completes from the
  Trainer; ``self.model`` is a thin ``nn.Module`` whose forward is the engine's, so Lightning's forward
  redirection runs ``training_step`` inside the module's ``__call__`` (stage 3's gather hooks fire).
- ``backward``: ``engine.backward(loss, scale_wrt_gas=False)`` -- Lightning has already divided the loss by
  ``accumulate_grad_batches``, the same division the engine makes (R5), so the gradients are the plain loop's.
- ``optimizer_step``: runs Lightning's closure (training_step, zero_grad, backward) and ``engine.step()`` on every
  batch (``handles_gradient_accumulation``); the engine updates at its boundaries, which the config resolution
  made Lightning's, so ``global_step``, LR schedulers and ``on_before_optimizer_step`` move with the updates.
- checkpoints: ``save_checkpoint`` / ``load_checkpoint`` (the hooks Lightning routes through ``checkpoint_io``)
  write and read the engine's format -- a directory per Lightning checkpoint path, tag ``checkpoint``, the Trainer's
  own state (loops, callbacks, LR schedulers) as the engine's ``client_state``, committed in the same rename.

The optimizer: the engine runs its own update (R16). ``configure_optimizers`` may return torch's SGD, Adam or
AdamW (one group over the trainable parameters), read for its type and hyper-parameters; LR schedulers on it are
Lightning's as usual, and the values they set are copied to the engine's optimizer before each update and before
a save. When ``configure_optimizers`` returns None (Lightning requires the method) the config's optimizer section
is used and ``engine.optimizer`` is Lightning's optimizer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from optimized.accumulation.engine import DEFAULT_BUCKET_ELEMENTS, ZeroEngine
from optimized.integrations.lightning_config import TrainerSettings, optimizer_section, resolve_config
from optimized.integrations.lightning_package import load_lightning
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.errors import ConfigurationError, UnsupportedOperationError

__all__ = ["CHECKPOINT_TAG", "ZeroStrategy"]

#: The engine checkpoint tag under each Lightning checkpoint path (a directory, as with DeepSpeed's strategy).
CHECKPOINT_TAG = "checkpoint"

_PL = load_lightning()


def _sub(path: str) -> Any:
    return importlib.import_module(f"{_PL.__name__}.{path}")


DDPStrategy: Any = _sub("strategies").DDPStrategy  # lightning is untyped here (pyproject.toml)
TrainerFn = _sub("trainer.states").TrainerFn
_call = _sub("trainer.call")
_is_overridden = _sub("utilities.model_helpers").is_overridden
_init_optimizers = _sub("core.optimizer")._init_optimizers_and_lr_schedulers
_rank_zero_warn = _sub("utilities.rank_zero").rank_zero_warn

#: DDPStrategy's arguments this strategy passes on (its other keywords configure torch's DDP wrapper, unused here).
DDP_ARGUMENTS = ("accelerator", "parallel_devices", "cluster_environment", "precision_plugin",
                 "process_group_backend", "timeout", "start_method")
#: Hyper-parameters of an optimizer group the engine reads at each update (engine.optimizer's group keys).
_HYPER = ("lr", "betas", "eps", "weight_decay", "momentum")


class _EngineModule(nn.Module):
    """What Lightning sees as ``strategy.model``: the LightningModule as a child (``train()`` / ``eval()`` reach
    it) and a forward that is the engine's (R20's output mark, stage 3's hooks)."""

    engine: ZeroEngine

    def __init__(self, engine: ZeroEngine) -> None:
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "engine", engine)  # not an nn.Module: kept out of the module tree

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)


def _plain(value: Any) -> Any:
    """Lightning's checkpoint dict with dict / list / tuple subclasses (``AttributeDict`` hyper-parameters, named
    tuples) turned into the plain containers the engine's ``client_state`` stores; other values as they are (the
    engine refuses, by name, what a ``weights_only`` load could not read back)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


class ZeroStrategy(DDPStrategy):
    """Train a ``LightningModule`` with a :class:`~optimized.accumulation.ZeroEngine` per process.

    ``config``: the engine config (flat or DeepSpeed's nested shape, or an ``AccumulationConfig``); accumulation,
    clipping and dtype are completed from the Trainer and must agree with it where both give them.
    ``bucket_elements``, ``prefetch``: the engine's. The other keywords are DDPStrategy's (``accelerator``,
    ``parallel_devices``, ``cluster_environment``, ``precision_plugin``, ``process_group_backend``, ``timeout``,
    ``start_method``); ``checkpoint_io`` is refused: checkpoints are the engine's format.
    """

    strategy_name = "hostoffload_zero"

    def __init__(
        self,
        config: AccumulationConfig | Mapping[str, Any] | None = None,
        *,
        bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
        prefetch: bool = True,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(DDP_ARGUMENTS))
        if unknown:
            raise ConfigurationError(
                f"ZeroStrategy got unknown argument(s) {', '.join(unknown)}; allowed: config, bucket_elements, "
                f"prefetch, {', '.join(DDP_ARGUMENTS)}"
                + (" (checkpoints are written in the engine's own format)" if "checkpoint_io" in unknown else "")
            )
        if config is not None and not isinstance(config, (Mapping, AccumulationConfig)):
            raise ConfigurationError(
                f"config={config!r} must be None, an AccumulationConfig or a mapping (flat keys or DeepSpeed's "
                f"nested shape)"
            )
        super().__init__(**kwargs)
        self._config = config
        self._engine_kwargs: dict[str, Any] = {"bucket_elements": bucket_elements, "prefetch": prefetch}
        self._engine: ZeroEngine | None = None
        #: The optimizer configure_optimizers returned (Lightning's, schedulers act on it), or None.
        self._user_optimizer: torch.optim.Optimizer | None = None
        self._failed = False

    # ---- what the strategy is built on -----------------------------------------------------------------------
    @property
    def engine(self) -> ZeroEngine:
        """This process's engine (after the Trainer's setup)."""
        if self._engine is None:
            raise UnsupportedOperationError("ZeroStrategy.engine exists once the Trainer has set the strategy up")
        return self._engine

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine, which reads the checkpoint, exists only after setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint restores its optimizer state (Lightning still restores schedulers)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Not registered by name: pass an instance, ``Trainer(strategy=ZeroStrategy(config))``."""

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.release_engine()  # a strategy set up again (fit, then validate) builds a new engine
        self._failed, self._user_optimizer = False, None
        if self._layer_sync is not None:
            raise ConfigurationError(
                "Trainer(sync_batchnorm=True) is not supported by ZeroStrategy (the engine wraps the module as it "
                "is); allowed: sync_batchnorm=False, or convert the BatchNorm layers in the module yourself"
            )
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        settings = TrainerSettings(
            accumulate_grad_batches=trainer.accumulate_grad_batches, gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=_algorithm_name(trainer.gradient_clip_algorithm) if
            trainer.gradient_clip_val is not None else None,
            precision=str(self.precision_plugin.precision), automatic_optimization=module.automatic_optimization,
            micro_batch_size=_loader_batch_size(trainer) if fitting and self._auto_micro_batch() else None,
        )
        optimizers, schedulers = self._module_optimizers(module) if fitting else ([], [])
        trainable = [p for p in module.parameters() if p.requires_grad]
        section = optimizer_section(optimizers[0], trainable) if optimizers else None
        config = resolve_config(self._config, settings, section, self.world_size)
        if _is_overridden("configure_gradient_clipping", module, _PL.LightningModule):
            _rank_zero_warn("ZeroStrategy: the engine clips by the global norm (gradient_clipping / Trainer("
                            "gradient_clip_val=...)); LightningModule.configure_gradient_clipping is not called")
        self._engine = engine = ZeroEngine(module, config, device=self.root_device, **self._engine_kwargs)
        self.model = _EngineModule(engine)
        if fitting:
            self._user_optimizer = optimizers[0] if optimizers else None
            self.optimizers = [self._user_optimizer or engine.optimizer]
            self.lr_scheduler_configs = schedulers
        self.setup_precision_plugin()

    def _auto_micro_batch(self) -> bool:
        """Whether the config asks for the DataLoader's batch size (only then is the loader asked for it)."""
        value = self._config.get("train_micro_batch_size_per_gpu") if isinstance(self._config, Mapping) else None
        return isinstance(value, str) and value.lower() == "auto"

    def _module_optimizers(self, module: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
        """``configure_optimizers``'s optimizer and LR scheduler configs (none when it is not overridden)."""
        if not _is_overridden("configure_optimizers", module, _PL.LightningModule):
            return [], []
        optimizers, schedulers = _init_optimizers(module)
        optimizers = [o for o in optimizers if type(o).__name__ != "_MockOptimizer"]  # configure_optimizers -> None
        if len(optimizers) > 1:
            raise ConfigurationError(
                f"configure_optimizers returned {len(optimizers)} optimizers; the engine runs one update over every "
                f"trainable parameter; allowed: one optimizer"
            )
        return optimizers, schedulers

    def model_to_device(self) -> None:
        """The engine placed the module on ``root_device`` when it was built."""

    # ---- a training step --------------------------------------------------------------------------------------
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's hooks around ``engine.backward`` (the loss is already divided by accumulate_grad_batches,
        which equals the engine's gradient_accumulation_steps)."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.engine.backward(closure_loss, scale_wrt_gas=False)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """One batch: the closure (training_step, zero_grad, backward), then ``engine.step()`` -- an update at the
        accumulation boundary, where ``on_before_optimizer_step`` runs first and the Lightning optimizer's
        hyper-parameters (as its schedulers left them) are handed to the engine."""
        engine = self.engine
        if closure() is None:
            raise UnsupportedOperationError(
                "training_step returned None (skip this batch); the hostoffload strategy needs a loss every batch "
                "(the engine's accumulation counts micro-steps); allowed: return a loss"
            )
        if engine.is_gradient_accumulation_boundary():
            trainer = self.lightning_module.trainer
            _call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
            _call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
            self._hyper_to_engine()
        outcome = engine.step()
        if outcome.boundary and self._user_optimizer is not None:
            # What torch's scheduler wrapper of optimizer.step() records, so that Lightning's scheduler step after
            # this update does not warn that the optimizer never stepped (the engine updated in its place).
            self._user_optimizer._opt_called = True  # type: ignore[attr-defined]  # torch's private flag
        return outcome

    def _hyper_to_engine(self) -> None:
        if self._user_optimizer is not None:
            _copy_hyper(self._user_optimizer, self.engine.optimizer)

    # ---- checkpoints (Lightning's checkpoint_io hooks, in the engine's format) --------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank: ``engine.save_checkpoint(filepath, tag='checkpoint', client_state=<the Trainer's state>)``
        (weights and optimizer state are the engine's, so Lightning's ``state_dict`` / ``optimizer_states`` are
        left out)."""
        if storage_options is not None:
            raise ConfigurationError(
                "Trainer.save_checkpoint(storage_options=...) is not supported by ZeroStrategy (the engine writes "
                "its own checkpoint format, not through checkpoint_io); allowed: storage_options=None"
            )
        filepath = self.broadcast(str(filepath))
        self._hyper_to_engine()
        client = _plain({k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")})
        self.engine.save_checkpoint(filepath, tag=CHECKPOINT_TAG, client_state=client)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The engine's ``load_checkpoint`` (optimizer state and group values only when fitting; the engine has no
        scheduler of its own, Lightning restores its schedulers from the returned state); returns the Trainer's state
        saved with it, and puts the restored hyper-parameters back on Lightning's optimizer."""
        path = self.broadcast(str(checkpoint_path))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        engine = self.engine
        _, client = engine.load_checkpoint(
            path, tag=CHECKPOINT_TAG, load_optimizer_states=fitting, load_lr_scheduler_states=fitting,
            load_module_only=not fitting,
        )
        if fitting and self._user_optimizer is not None:
            _copy_hyper(engine.optimizer, self._user_optimizer)
        return dict(client)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: ``load_checkpoint`` loaded the weights into the engine."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: ``load_checkpoint`` loaded the optimizer state into the engine."""

    # ---- the end of a run -------------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown must not start a collective another rank may never join
        super().on_exception(exception)

    def teardown(self) -> None:
        """The engine outlives ``fit`` (as DeepSpeed's does), so ``trainer.save_checkpoint`` after it works and the
        weights stay where the engine keeps them; it is destroyed when this strategy is set up again or by
        :meth:`release_engine`, and at once after a failure. Lightning's own teardown moves the module to the CPU,
        which would take the parameters away from a live engine's buffers: only its plugin teardowns run here."""
        if self._failed:
            self.release_engine(gather=False)
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def release_engine(self, gather: bool = True) -> None:
        """Destroy the engine (hooks removed, pinned buffers released) and hand the LightningModule back as a plain
        module with the trained weights; at stage 3 they are gathered first (a collective every rank calls; skipped
        with ``gather=False``, after a failure, leaving stage-3 parameters empty). A no-op without an engine."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        full = engine.full_parameters() if engine.stage == 3 and gather else None
        engine.destroy()
        if full is not None:
            with torch.no_grad():
                for name, p in engine.module.named_parameters():
                    p.data = full[name]
        self.model = self.lightning_module


def _copy_hyper(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """The update's hyper-parameters (those both groups have) from ``source``'s group to ``target``'s."""
    src, dst = source.param_groups[0], target.param_groups[0]
    for key in _HYPER:
        if key in src and key in dst:
            value = src[key]
            dst[key] = float(value) if isinstance(value, (int, float, torch.Tensor)) else value
    if "initial_lr" in src:
        dst["initial_lr"] = src["initial_lr"]


def _loader_batch_size(trainer: Any) -> int | None:
    """The training DataLoader's batch size, or None where Lightning does not know it yet (the fit loop's data
    source, as Lightning's DeepSpeed strategy reads it; never an error: "auto" is then left to the defaults)."""
    try:
        source = trainer.fit_loop._data_source
        loader = source.dataloader() if source.is_defined() else None
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    except Exception:  # a private attribute of Lightning that another version may lack
        return None
    return size if type(size) is int and size >= 1 else None


def _algorithm_name(algorithm: Any) -> str | None:
    return None if algorithm is None else str(getattr(algorithm, "value", algorithm))
