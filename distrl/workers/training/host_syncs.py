"""Counting the calls that make the host wait for the device: a test of a step's host synchronisations on any
device, the CPU included.

On a GPU, kernels run behind the host: the host queues work and goes on, unless it asks for a value that only the
device has. Each such read (`item`, `tolist`, `float`/`int`/`bool` of a tensor, `.cpu()`, `nonzero` and boolean-mask
indexing, whose output size is data), and each blocking host-to-device copy (`.to(device)` without
`non_blocking=True`, `torch.tensor(..., device=...)`: torch waits for the stream after a pageable copy), drains the
queue: the GPU idles until the host has queued the next kernels. `HostSyncs` counts these calls where they are made
from distrl's code or the model library's (transformers, peft), whatever the device, so that a CPU test bounds a GPU
step's synchronisations. Calls made inside torch (a non-fused optimizer reading its step counters, which live on the
host) are not counted: whether they wait is torch's choice of implementation, measured on the GPU instead
(`torch.cuda.set_sync_debug_mode`, tests/gpu).

Host-side layout code works on numpy arrays (`Tensor.numpy()` fails on a CUDA tensor, so it never waits), which is
why it is not counted.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

COUNTED_PACKAGES = ("distrl", "transformers", "peft")
"""Calls whose caller's file lies in one of these packages are counted."""

_READS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__float__: "float",
          torch.Tensor.__int__: "int", torch.Tensor.__bool__: "bool", torch.Tensor.__index__: "index",
          torch.Tensor.cpu: "cpu", torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero",
          torch.argwhere: "nonzero", torch.Tensor.argwhere: "nonzero", torch.masked_select: "masked_select",
          torch.Tensor.masked_select: "masked_select", torch.equal: "equal", torch.unique: "unique",
          torch.Tensor.unique: "unique"}


def package_roots() -> tuple[str, ...]:
    """The directories of `COUNTED_PACKAGES` (those installed)."""
    import importlib.util

    roots = []
    for name in COUNTED_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots += [str(Path(p).resolve()) + "/" for p in spec.submodule_search_locations]
    return tuple(roots)


def _bool_index(index) -> bool:
    """Whether an index (of `x[index]`) holds a boolean tensor: its output size depends on the data."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in items)


def _kind(func, args, kwargs) -> str | None:  # noqa: PLR0911 - one return per kind of call
    """The kind of host synchronisation the call `func(*args, **kwargs)` makes, None for none."""
    if func in _READS:
        return _READS[func]
    if func is torch.Tensor.__getitem__ and _bool_index(args[1]):
        return "bool_index"
    if func is torch.Tensor.__setitem__ and _bool_index(args[1]):
        return "bool_index"
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "nonzero"
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and "output_size" not in kwargs:
        return "repeat_interleave" if isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                 torch.Tensor) else None
    if func is torch.Tensor.to:
        target = next((a for a in args[1:] if isinstance(a, (str, torch.device))), kwargs.get("device"))
        # A move to the tensor's own device given as a device object (model code's `x.to(y.device)`) copies nothing;
        # a device named by a string may be another on a GPU machine, where the same code runs.
        if target is not None and not kwargs.get("non_blocking", False) and target != args[0].device:
            return "to_device"
    if func is torch.tensor and kwargs.get("device") is not None:
        return "to_device"
    return None


class HostSyncs(TorchFunctionMode):
    """`with HostSyncs() as syncs: ...` counts the calls of the block that would make the host wait for a device,
    made from distrl's, transformers' or peft's code (module docstring), or from the files under `roots` when given:
    `syncs.total`, and `syncs.calls`, a Counter of (kind, "file:line")."""

    def __init__(self, roots: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str]] = Counter()
        self._roots = package_roots() if roots is None else roots

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        if kind is not None:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(self._roots):
                self.calls[(kind, f"{caller.f_code.co_filename}:{caller.f_lineno}")] += 1
        return func(*args, **kwargs)

    def report(self) -> str:
        """One line per call site, most frequent first."""
        return "\n".join(f"{n:4d} {kind:<18} {where}" for (kind, where), n in self.calls.most_common())
