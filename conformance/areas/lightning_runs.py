"""One rank of the Lightning strategy checks (harness machinery: ``test_accumulation_lightning`` starts it as
torchrun would, once per rank, and compares what the ranks write).

``python -m conformance.areas.lightning_runs AREA_MODULE OUT_DIR`` with ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT`` set. ``AREA_MODULE`` is the accumulation area module of the implementation under
test: its ``ZeroEngine`` and its declared ``lightning_strategy`` (a module with ``ZeroStrategy``) are used, never
ours. Lightning sees processes started outside it (``LOCAL_RANK`` set) and joins them into one gloo group; the
plain engine loops run on that same group afterwards. Each case runs a Trainer and the plain loop a user would
write for the same config and data, and records both (losses of every micro-batch, step outcomes, final full
parameters, counters); ``OUT_DIR/rank<r>.pt`` holds a dict case -> record. Everything is deterministic: the models
are built from fixed seeds, each rank's batches from its rank.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from typing import Any

import torch
from torch import nn

#: Micro-batches per epoch on each rank, and their shape.
BATCHES, BATCH, FEATURES, OUTPUTS = 8, 4, 8, 2


def _schedule(step: int) -> float:
    """The LR schedule of the cases (a warm-up, so every boundary's lr differs)."""
    return min(1.0, (step + 1) / 6)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, OUTPUTS, generator=g))
            for _ in range(BATCHES)]


def _module_class(pl: Any) -> type:
    class Tiny(pl.LightningModule):
        """A two-layer net; AdamW + a LambdaLR warm-up from configure_optimizers; records what it computes."""

        def __init__(self, seed: int, optimizer: dict[str, Any]) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.GELU(), nn.Linear(16, OUTPUTS))
            self.opt = optimizer
            self.losses: list[torch.Tensor] = []
            #: per boundary: (grad_norm, clip_coef, the lr it used, the optimizer's step)
            self.outcomes: list[tuple[float, float | None, float, int]] = []
            self.val_losses: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.val_losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self) -> Any:
            o = self.opt
            if o is None:  # the strategy's config holds the optimizer (no schedule)
                return None
            opt = torch.optim.AdamW(self.parameters(), lr=o["lr"], betas=o["betas"], weight_decay=o["weight_decay"])
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            engine = self.trainer.strategy.engine
            out = optimizer.step(closure=optimizer_closure)
            if out.boundary:  # the lr this update used (Lightning steps its scheduler after this hook)
                self.outcomes.append((out.grad_norm, out.clip_coef, engine.get_lr()[0], engine.optimizer_state().step))

    return Tiny


def _trainer(pl: Any, strategy: Any, world: int, **kwargs: Any) -> Any:
    options = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
               "enable_model_summary": False, "use_distributed_sampler": False, "num_sanity_val_steps": 0,
               "default_root_dir": tempfile.mkdtemp(prefix="lightning-run-", dir=os.getcwd()), **kwargs}
    return pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, **options)


def _loader(rank: int) -> Any:
    return torch.utils.data.DataLoader(_batches(rank), batch_size=None)  # type: ignore[arg-type]  # a list is a map-style dataset


def _plain_loop(area: Any, module: nn.Module, config: dict[str, Any], rank: int, epochs: int,
                dtype: torch.dtype = torch.float32, scheduled: bool = True) -> dict[str, Any]:
    """What a user writes without Lightning: engine, LambdaLR on engine.optimizer (unless not ``scheduled``),
    backward/step per batch (the batch cast to the model's ``dtype``, as a bf16 engine needs)."""
    engine = area.ZeroEngine(module, config)
    if scheduled:
        engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, _schedule)
    losses, outcomes = [], []
    for _ in range(epochs):
        for x, y in _batches(rank):
            loss = nn.functional.mse_loss(engine(x.to(dtype)), y.to(dtype))
            losses.append(loss.detach().clone())
            engine.backward(loss)
            lr = engine.get_lr()[0]
            out = engine.step()
            if out.boundary:
                outcomes.append((out.grad_norm, out.clip_coef, lr, engine.optimizer_state().step))
    record = {"losses": losses, "outcomes": outcomes, "params": engine.state_dict(),
              "global_steps": engine.global_steps}
    engine.destroy()
    return record


def _lightning_record(module: Any, trainer: Any) -> dict[str, Any]:
    strategy = trainer.strategy
    return {"losses": list(module.losses), "outcomes": list(module.outcomes), "params": strategy.engine.state_dict(),
            "global_steps": strategy.engine.global_steps, "trainer_global_step": trainer.global_step}


def case_equivalence(pl: Any, area: Any, rank: int, world: int, root: str) -> dict[str, Any]:
    """Stage 2 + optimizer offload; accumulation, clipping and the optimizer given to the Trainer and the module
    only (the strategy's config names none of them) against the plain loop with all of them in its config. A
    ``ModelCheckpoint`` saves every 2 updates keeping the last one; a plain engine loads what it wrote."""
    Tiny = _module_class(pl)
    opt = {"lr": 0.05, "betas": (0.9, 0.99), "weight_decay": 0.01}
    strategy = area.lightning_strategy.ZeroStrategy({"zero_stage": 2, "offload_optimizer": "cpu"})
    module = Tiny(0, opt)
    saves = os.path.join(root, "model-checkpoint")
    callback = pl.callbacks.ModelCheckpoint(dirpath=saves, every_n_train_steps=2, save_top_k=1)
    trainer = _trainer(pl, strategy, world, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=0.05,
                       enable_checkpointing=True, callbacks=[callback])
    trainer.fit(module, _loader(rank))
    ours = _lightning_record(module, trainer)
    strategy.release_engine()
    config = {"zero_stage": 2, "offload_optimizer": "cpu", "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.05, "optimizer": {"type": "adamw", **opt}}
    plain = _plain_loop(area, Tiny(0, opt), config, rank, epochs=1)
    saved = sorted(os.listdir(saves))
    reader = area.ZeroEngine(Tiny(7, opt), config)  # other initial weights: what it holds after the load is read
    _, client = reader.load_checkpoint(os.path.join(saves, saved[-1]))
    loaded = {"params": reader.state_dict(), "global_steps": reader.global_steps,
              "client_keys": sorted(client), "client_global_step": client.get("global_step")}
    reader.destroy()
    return {"lightning": ours, "plain": plain, "saves": {n: sorted(os.listdir(os.path.join(saves, n))) for n in saved},
            "loaded": loaded}


def case_bf16(pl: Any, area: Any, rank: int, world: int) -> dict[str, Any]:
    """``Trainer(precision="bf16-true")`` (Lightning casts the batch) with a config that names no dtype, stage 1,
    and the optimizer in the config (``configure_optimizers`` returns None), against the plain loop of a ``bf16``
    config that casts its batches."""
    Tiny = _module_class(pl)
    opt = {"type": "adamw", "lr": 0.05, "betas": (0.9, 0.999), "weight_decay": 0.0}
    strategy = area.lightning_strategy.ZeroStrategy({"zero_stage": 1, "gradient_clipping": 1.0, "optimizer": opt})
    module = Tiny(0, None)
    trainer = _trainer(pl, strategy, world, max_epochs=1, accumulate_grad_batches=2, precision="bf16-true")
    trainer.fit(module, _loader(rank))
    ours = _lightning_record(module, trainer)
    strategy.release_engine()
    plain = _plain_loop(area, Tiny(0, None), {
        "zero_stage": 1, "dtype": "bf16", "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "optimizer": opt,
    }, rank, epochs=1, dtype=torch.bfloat16, scheduled=False)
    return {"lightning": ours, "plain": plain}


def case_resume(pl: Any, area: Any, rank: int, world: int, root: str) -> dict[str, Any]:
    """Stage 3 with parameter and optimizer offload, DeepSpeed-shaped config: one epoch,
    ``trainer.save_checkpoint``, a fresh module (other seed) and Trainer resumed with ``ckpt_path`` for a second
    epoch, against two uninterrupted epochs of the plain loop; then ``validate(ckpt_path=...)`` of a third module."""
    Tiny = _module_class(pl)
    opt = {"lr": 0.05, "betas": (0.9, 0.999), "weight_decay": 0.0}
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    config = {"zero_optimization": zero, "gradient_clipping": 1.0}
    first = Tiny(0, opt)
    t1 = _trainer(pl, area.lightning_strategy.ZeroStrategy(config), world, max_epochs=1, accumulate_grad_batches=2)
    t1.fit(first, _loader(rank))
    path = os.path.join(root, "epoch0.ckpt")
    t1.save_checkpoint(path)
    layout = sorted(os.listdir(path))
    saved = t1.strategy.engine.state_dict()
    t1.strategy.release_engine()  # stage 3: gathers the weights back into the module
    released = {n: p.detach().clone() for n, p in first.named_parameters()}
    second = Tiny(1, opt)
    t2 = _trainer(pl, area.lightning_strategy.ZeroStrategy(config), world, max_epochs=2, accumulate_grad_batches=2)
    t2.fit(second, _loader(rank), ckpt_path=path)
    ours = _lightning_record(second, t2)
    ours["losses"] = list(first.losses) + ours["losses"]
    ours["outcomes"] = list(first.outcomes) + ours["outcomes"]
    t2.strategy.release_engine()
    plain = _plain_loop(area, Tiny(0, opt), {"zero_optimization": zero, "gradient_clipping": 1.0,
                                             "gradient_accumulation_steps": 2,
                                             "optimizer": {"type": "AdamW", "params": dict(opt)}}, rank, epochs=2)
    third = Tiny(2, opt)
    t3 = _trainer(pl, area.lightning_strategy.ZeroStrategy(config), world)
    t3.validate(third, _loader(rank), ckpt_path=path, verbose=False)
    validated = t3.strategy.engine.state_dict()
    t3.strategy.release_engine()
    return {"lightning": ours, "plain": plain, "layout": layout, "saved": saved, "released": released,
            "validated": validated, "validation_losses": len(third.val_losses)}


def case_refusal(pl: Any, area: Any, rank: int, world: int) -> dict[str, Any]:
    """Refused at setup, on every rank, by name: a config whose accumulation disagrees with the Trainer's, and
    ``Trainer(sync_batchnorm=True)`` (which the strategy would otherwise ignore)."""
    Tiny = _module_class(pl)
    out: dict[str, Any] = {}
    for name, config, options in (
        ("error", {"zero_stage": 1, "gradient_accumulation_steps": 4}, {"accumulate_grad_batches": 2}),
        ("sync_batchnorm", {"zero_stage": 1}, {"sync_batchnorm": True}),
    ):
        trainer = _trainer(pl, area.lightning_strategy.ZeroStrategy(config), world, max_epochs=1, **options)
        try:
            trainer.fit(Tiny(0, {"lr": 0.05, "betas": (0.9, 0.999), "weight_decay": 0.0}), _loader(rank))
            out[name] = None
        except Exception as exc:  # reported to the test, which classifies it
            out[name] = (type(exc).__name__, str(exc))
    return out


def main(argv: list[str]) -> int:
    area_name, out = argv[0], argv[1]
    area = importlib.import_module(area_name)
    pl = area.lightning_strategy.load_lightning()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    root = os.path.join(out, "shared")  # the checkpoint directory every rank saves into
    os.makedirs(root, exist_ok=True)
    results = {
        "equivalence": case_equivalence(pl, area, rank, world, root),
        "bf16": case_bf16(pl, area, rank, world),
        "resume": case_resume(pl, area, rank, world, root),
        "refusal": case_refusal(pl, area, rank, world),
    }
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
