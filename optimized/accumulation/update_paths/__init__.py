"""Update paths: how one rank of a ZeroEngine turns its accumulated gradient into new weights (R9-R17, R27).

The ``offload_optimizer`` value (with ``delayed_parameter_update``, the stage and the optimizer) is decoded in one
place, :func:`update_path_class`, into one of these classes; the engine builds the object once, at construction,
and delegates to it. Nothing in the engine tests the config again.

=====================================  ==========================================================  ==============
path                                   chosen when                                                 module
=====================================  ==========================================================  ==============
:class:`DeviceUpdate`                  ``offload_optimizer: none``                                 :mod:`.whole`
:class:`HostUpdate`                    ``cpu``, not streamed (stage 0/1, SGD, no native CPU Adam)  :mod:`.whole`
:class:`NvmeUpdate`                    ``nvme``                                                    :mod:`.whole`
:class:`StreamedHostUpdate`            ``cpu``, stage 2/3, Adam/AdamW, native kernel               :mod:`.streamed`
=====================================  ==========================================================  ==============

The streamed path is one class assembled from three choices the config makes (``delayed_parameter_update``: R27's
release one boundary later; ``gpu_share`` other than 0: R28's device side; ``host_update_start:
last_backward``: R30's speculative stage), looked up once in one table of the legal combinations
(:data:`~.streamed.STREAMED_CHOICES`, :func:`~.streamed.streamed_choices`) into a
:class:`~.streamed.StreamedChoices`. Its stages are one object each: the gradient stream off the device
(:mod:`.gradient_stream`, with R14's sums :mod:`.norm_sums` and the middle backwards' host adds
:mod:`.host_sums`), the host update worker (:mod:`.host_worker`), the weight upload (:mod:`.weight_upload`), the
timings (:mod:`.timings`), a release policy (:mod:`.release`) and, where chosen, a device side (:mod:`.split`) and
a speculative stage (:mod:`.speculation`). Each refusal of a choice the build cannot stream is written once, in
:func:`update_path_class`.

The interface (:class:`~.base.UpdatePath`; defaults there describe a path with nothing in flight). A path owns
its buffers (master, optimizer state, gradient accumulator, cast and staging buffers; host memory through the
context's :class:`~optimized.accumulation.host_buffers.HostBuffers`), its boundary epilogue and its checkpoint
state. The engine keeps the training surface, the parameters (:class:`~optimized.accumulation.weights.LiveWeights`),
the gradient buckets and their reduce-scatters, the stage-3 gathers and the schedule, and calls:

- construction: ``cls.check_config(config)`` before touching the model (e.g. ``nvme_path`` writable), then
  ``cls(ctx)`` with an :class:`~.base.UpdateContext` (config, layout, rank, world size, stage, device,
  collectives, live weights -- whose ``initial`` is the broadcast starting point of the master --, host
  buffers, gradient buckets, ``boundaries_done()``: R3's boundary count, e.g. for R27's warm-up; ``hyper_now()``:
  the hyper-parameters a step now would use, R30's guess); afterwards
  ``install_forward_waits(module, names_of, add_hook)``;
- attributes: ``master`` (fp32, this rank's range: whole at stage 0), ``opt_state`` (its ``step`` is the R16
  step count), ``accumulator`` (stages 0/1: the full flat buffer the engine's gradient hooks add into, on the
  device; stages 2/3: this rank's partition, filled by the path) and ``lags_parameters`` (R27);
- every backward: ``begin_backward(boundary_predicted)``; at stages 2/3, ``bucket_gradients(bucket)`` (where the
  hooks copy the gradients), ``bucket_launched(bucket)`` after each reduce-scatter is launched and
  ``finish_backward(buckets)`` once all are (the path adds this rank's reduced slices into its accumulator);
- every step: ``before_step()``; at a boundary ``boundary(hyper, record_gradients) -> StepOutcome`` (R13-R16
  with this boundary's hyper-parameters: norm and clip through :mod:`reference.contract.accumulation_norm`, the
  R14 sum across ranks through ``_norm``; the path writes its new model-dtype range through
  ``ctx.weights.write``);
- waits: ``synchronize()``, ``wait_range(lo, hi)`` (stage-3 gathers), ``apply_delayed()``;
- state: ``zero_grad()``, ``optimizer_state()`` (a copy; its buffers are the config's
  ``state_buffer_names``), ``live_weights_to_save()`` (R27),
  ``install(master, opt_buffers, applied)`` (checkpoint load, ``load_state_dict``); and ``close()`` from
  ``destroy()`` (never raises, never communicates);
- reports, for benchmarks and inspection: ``reports`` (a :class:`~.base.PathReports`: ``offload_timings()``,
  ``split_report()``, ``overlap_report()``, ``resident_buffers()``, ``swap_directory``, ``swap_stats()``; its
  defaults report nothing).

A new kind of path is one more class here and one more branch in :func:`update_path_class`; a new choice of the
streamed path is one more field of :class:`~.streamed.StreamedChoices` and its rows in the table; checkpoints stay in
parameter coordinates (``master`` and ``optimizer_state()`` cover this rank's whole range), so they load at any
other path.
"""

from __future__ import annotations

from optimized.accumulation.optimizers import native_adam
from optimized.accumulation.update_paths.base import PathReports, UpdateContext, UpdatePath
from optimized.accumulation.update_paths.streamed import (
    STREAMED_CHOICES,
    StreamedChoices,
    StreamedHostUpdate,
    streamed_choices,
)
from optimized.accumulation.update_paths.whole import DeviceUpdate, HostUpdate, NvmeUpdate
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.errors import ConfigurationError

__all__ = [
    "STREAMED_CHOICES",
    "DeviceUpdate",
    "HostUpdate",
    "NvmeUpdate",
    "PathReports",
    "StreamedChoices",
    "StreamedHostUpdate",
    "UpdateContext",
    "UpdatePath",
    "streamed_choices",
    "update_path_class",
]


def _streamed_only(config: AccumulationConfig) -> list[tuple[str, str]]:
    """The settings of ``config`` that only the streamed path has, each with the value that does without it."""
    wanted = []
    if config.gpu_share != 0.0:
        wanted.append((f"gpu_share={config.gpu_share!r}", "gpu_share=0.0"))
    if config.delayed_parameter_update:
        wanted.append(("delayed_parameter_update=True", "delayed_parameter_update=False"))
    if config.host_update_start == "last_backward":
        wanted.append(("host_update_start='last_backward'", "host_update_start='step'"))
    return wanted


def update_path_class(config: AccumulationConfig) -> type[UpdatePath]:
    """The update path ``config`` selects (the only place ``offload_optimizer`` is decoded; the streamed path's own
    choices are :func:`~.streamed.streamed_choices`'). R19 already put the streamed-only settings in the streamed
    path's domain (``offload_optimizer: cpu``, stage 2/3, Adam); what is left to refuse is a build without the
    native CPU Adam."""
    if config.offload_optimizer == "none":
        return DeviceUpdate
    if config.offload_optimizer == "nvme":
        return NvmeUpdate
    if config.zero_stage >= 2 and native_adam(config.optimizer):
        return StreamedHostUpdate
    wanted = _streamed_only(config)
    if wanted:
        raise ConfigurationError(
            f"{', '.join(w for w, _ in wanted)} needs the streamed host update and so the native CPU Adam "
            f"(optimized.cpu_adam), which this build does not have; allowed: {', '.join(a for _, a in wanted)}, or "
            f"a build with the native extension"
        )
    return HostUpdate
