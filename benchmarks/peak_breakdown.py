"""What the peak GPU memory of an arm is made of (issue 49 item 2), measured the same way for every arm.

CUDA's caching allocator can record every allocation and free with the Python stack that made it
(``torch.cuda.memory._record_memory_history``). :class:`PeakRecorder` turns that on before the model exists,
marks the phases of the arm (model built, engine built, steps), and afterwards replays the trace: the moment the
live bytes were highest is the peak, and each block live at that moment is put in one category by where and when
it was allocated:

- ``weights``: allocated while the model was built (its parameters and buffers, at the model dtype);
- ``engine at construction``: allocated while the engine (ours, DeepSpeed's, a peer's) was set up and still
  live at the peak: flat gradient buffers, buckets, device-side optimizer state, staging;
- ``logits and loss``: allocated in a step by a line of the model or of the loss that mentions logits, lm_head or
  loss (the vocabulary-wide tensors: bf16 logits, their fp32 copy, log-softmax and their gradients);
- ``activations``: allocated by the model's forward otherwise (kept for the backward);
- ``gradients, engine code``: allocated in a step by the engine's own code (gradient hooks, buckets filled in the
  backward, the boundary's reductions, staging of the update);
- ``gradients, autograd``: allocated in a backward with no engine frame on the stack: parameter ``.grad`` tensors
  and the activations' gradients the autograd engine makes;
- ``other``: the rest (its largest blocks are listed with the line that made them).

The allocator's slack (reserved minus allocated at their peaks) is reported beside it. The classification reads
the source line of the innermost frame of the model package (``linecache``), so it needs no knowledge of the
engine: an arm's own files are recognised by the path prefixes it is given (``engine_paths``).
"""

from __future__ import annotations

import linecache
from collections.abc import Iterable

GIB = 2**30
#: the order categories are printed in
CATEGORIES = ("weights", "engine at construction", "activations", "logits and loss", "gradients, engine code",
              "gradients, autograd", "other")
#: frames of these files are the framework's own, never "where" an allocation was made (torch's package, not any
#: path that contains "torch/": the GPU box's environment lives in /opt/torch/.venv)
_FRAMEWORK = ("site-packages/torch/", "dist-packages/torch/", "/contextlib.py", "/functools.py", "/threading.py")
#: words of a model or loss line that make its allocation a vocabulary-wide one
_LOSS_WORDS = ("logits", "lm_head", "loss", "cross_entropy", "log_softmax")


def _where(frames: list[dict]) -> str:
    """The innermost frame outside torch's own code, as ``file:line name``, for the largest-blocks list."""
    for f in frames:
        if not any(p in f["filename"] for p in _FRAMEWORK):
            return f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
    return frames[0]["filename"].rsplit("/", 2)[-1] if frames else "(no Python frame)"


def classify(frames: list[dict], phase: str, engine_paths: Iterable[str], model_paths: Iterable[str]) -> str:
    """The category (one of :data:`CATEGORIES`) of a block allocated in ``phase`` (``model``, ``engine`` or
    ``steps``) with Python stack ``frames`` (innermost first, as the allocator records them).

    In a step, the innermost frame outside torch's own code decides: an engine file (its hooks, its boundary), a
    model or loss line (activations, or the vocabulary-wide tensors where the line names logits or loss). The
    autograd engine runs a CUDA backward on a thread of its own, so what it allocates there (parameter ``.grad``
    tensors, the activations' gradients, the logits' gradient too) has no Python frame at all; a backward run on
    the calling thread shows torch's ``backward`` frames only."""
    if phase == "model":
        return "weights"
    if phase == "engine":
        return "engine at construction"
    inner = 0  # the innermost frame outside torch's own code
    while inner < len(frames) and any(p in frames[inner]["filename"] for p in _FRAMEWORK):
        inner += 1
    in_backward = any(f["name"] in ("backward", "_engine_run_backward") for f in frames[:inner])
    if inner == len(frames) or in_backward:
        return "gradients, autograd"
    f = frames[inner]
    if any(p in f["filename"] for p in engine_paths):
        return "gradients, engine code"
    if any(p in f["filename"] for p in model_paths):
        text = linecache.getline(f["filename"], f["line"]).lower()
        if any(w in text for w in _LOSS_WORDS) or "loss" in f["filename"].rsplit("/", 1)[-1]:
            return "logits and loss"
        return "activations"
    return "other"


def replay(events: list[dict], phase_starts: dict[str, int], engine_paths: Iterable[str],
           model_paths: Iterable[str], top: int = 8) -> dict:
    """The breakdown of the highest live total over ``events`` (the allocator's trace, oldest first).
    ``phase_starts`` maps ``model``/``engine``/``steps`` to the index of the first event of that phase."""
    engine_paths, model_paths = tuple(engine_paths), tuple(model_paths)
    starts = sorted(phase_starts.items(), key=lambda kv: kv[1])

    def phase_of(i: int) -> str:
        name = "before"
        for p, s in starts:
            if i >= s:
                name = p
        return name

    live: dict[int, tuple[int, int]] = {}  # addr -> (size, event index)
    total = best = 0
    best_live: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(events):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], i)
            total += e["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif action == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    sums = dict.fromkeys(CATEGORIES, 0)
    blocks = []
    for size, i in best_live.values():
        e = events[i]
        phase = phase_of(i)
        cat = "other" if phase == "before" else classify(e.get("frames", []), phase, engine_paths, model_paths)
        sums[cat] += size
        blocks.append((size, cat, _where(e.get("frames", []))))
    blocks.sort(reverse=True)
    return {"peak_gib": best / GIB, "categories_gib": {k: v / GIB for k, v in sums.items()},
            "largest": [{"gib": s / GIB, "category": c, "where": w} for s, c, w in blocks[:top]]}


class PeakRecorder:
    """Records the CUDA allocator's trace of one arm from before its model exists (``start``), with the phase
    boundaries (``mark``); ``result`` replays it (:func:`replay`) and stops recording, so the timed steps that
    follow run without the recording's cost. A no-op where CUDA is absent (the row says so)."""

    def __init__(self, enabled: bool, engine_paths: Iterable[str], model_paths: Iterable[str] = ("transformers/",)):
        import torch

        self.enabled = enabled and torch.cuda.is_available()
        self.engine_paths, self.model_paths = tuple(engine_paths), tuple(model_paths)
        self._phases: dict[str, int] = {}
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=4_000_000, context="alloc", stacks="python")

    def _events(self) -> list[dict]:
        import torch

        return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]

    def mark(self, phase: str) -> None:
        """The events from now on belong to ``phase`` (``model``, ``engine``, ``steps``)."""
        if self.enabled:
            self._phases[phase] = len(self._events())

    def result(self) -> dict | str:
        if not self.enabled:
            return "not recorded (needs cuda)"
        import torch

        events = self._events()
        torch.cuda.memory._record_memory_history(enabled=None)
        out = replay(events, self._phases, self.engine_paths, self.model_paths)
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["slack_gib"] = (torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()) / GIB
        out["events"] = len(events)
        return out


def table(rows: list[dict]) -> str:
    """The breakdowns of ``rows`` (those with one) side by side: a column per arm, a line per category."""
    have = [r for r in rows if isinstance(r.get("peak_breakdown"), dict)]
    if not have:
        return ""
    head = ["GiB at the peak"] + [f"{r['arm']} (gas {r.get('gas')})" for r in have]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cat in CATEGORIES:
        lines.append("| " + " | ".join([cat] + [f"{r['peak_breakdown']['categories_gib'][cat]:.2f}"
                                                 for r in have]) + " |")
    for key, label in (("peak_gib", "peak of the trace"), ("max_memory_allocated_gib", "max_memory_allocated"),
                       ("slack_gib", "allocator slack (reserved - allocated)")):
        lines.append("| " + " | ".join([label] + [f"{r['peak_breakdown'][key]:.2f}" for r in have]) + " |")
    for r in have:
        lines.append(f"  {r['arm']} largest blocks at the peak: " + "; ".join(
            f"{b['gib']:.3f} {b['category']} ({b['where']})" for b in r["peak_breakdown"]["largest"]))
    return "\n".join(lines)
