"""The outputs of a replayed CUDA graph (``cudagraphs.GraphReplay``): which are views of
the graph's inputs, handed over as aliases or clones, moved out of the graph's buffers
when the caller still holds them, compared bit for bit. Tensors only; no capture here."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Sequence

import torch

log = logging.getLogger("stitch_backend.cudagraphs")


def input_views(outputs: Sequence[torch.Tensor], static_inputs: Sequence[Any]
                ) -> dict[int, tuple[int, tuple, tuple, int]]:
    """For each of ``outputs`` (flat) whose memory is one of ``static_inputs`` (the
    graph's inputs while capturing: parameters themselves, copies of the rest):
    position -> (input index, sizes, strides, element offset from that input's)."""
    by_storage = {x.untyped_storage().data_ptr(): i for i, x in enumerate(static_inputs)
                  if isinstance(x, torch.Tensor)}
    found = {}
    for j, t in enumerate(outputs):
        i = by_storage.get(t.untyped_storage().data_ptr())
        if i is not None:
            found[j] = (i, tuple(t.size()), tuple(t.stride()),
                        t.storage_offset() - static_inputs[i].storage_offset())
    return found


def _with_input_views(value: Any, views: dict[int, tuple[int, tuple, tuple, int]],
                      inputs: Sequence[torch.Tensor]) -> Any:
    """``value`` with the tensors at ``views``' flat positions replaced by those views
    of ``inputs`` (detached: autograd sees them as outputs, as it saw the captured ones)."""
    if not views:
        return value
    position = itertools.count()

    def swap(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            j = next(position)
            if j in views:
                i, size, stride, offset = views[j]
                x = inputs[i].detach()
                return x.as_strided(size, stride, x.storage_offset() + offset)
            return v
        if isinstance(v, (list, tuple)):
            return type(v)(swap(item) for item in v)
        return v

    return swap(value)


def _use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage: the tensors sharing its memory (Python storage
    objects are not counted)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of ``value`` (nested lists and tuples), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _alias(value: Any, found: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by an alias of it (same storage, sizes and
    strides; a tensor of its own the user may resize or rebind), collected in ``found``."""
    if isinstance(value, torch.Tensor):
        alias = value.detach()
        found.append(alias)
        return alias
    if isinstance(value, (list, tuple)):
        return type(value)(_alias(v, found) for v in value)
    return value


def _move_out(alias: torch.Tensor) -> bool:
    """Point ``alias`` (an output the user kept) at a copy of its values in memory of
    its own, with the copy's sizes and strides (``_clone``'s: the same, except that an
    expanded output becomes dense); False where ``set_`` fails.

    The values do not change, so autograd's version counter is kept as it was: a
    training forward's output the backward saved (or one it tracks, the loss's input)
    moved out before that backward ran still passes autograd's check that saved
    tensors were not modified in place. A saved copy autograd made of its own (an
    output saved by the op that made it) still holds the buffer: the caller's use
    count sees it."""
    with torch.no_grad():
        copy = _clone(alias)
    try:
        # no_grad inside inference_mode: inference_mode(False) turns grad mode back on
        with torch.inference_mode(alias.is_inference()), torch.no_grad(), \
                torch.autograd._unsafe_preserve_version_counter(alias):
            alias.set_(copy.untyped_storage(), copy.storage_offset(), copy.size(), copy.stride())
    except RuntimeError as err:
        log.debug("could not move a kept output out of the graph's buffer: %s", err)
        return False
    return True


def _clone(value: Any) -> Any:
    """A copy with the same sizes and strides: clone() alone makes a view with gaps (a
    slice of a wider buffer, as Mamba2's final state is) contiguous, and the strides are
    part of what eager returns. Outputs whose elements overlap (expanded) are cloned."""
    if isinstance(value, torch.Tensor):
        if value.is_contiguous() or _overlapping(value):
            return value.clone()
        out = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype,
                                  device=value.device)
        return out.copy_(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _overlapping(t: torch.Tensor) -> bool:
    """Whether two indices of ``t`` address one element (an expanded view)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz > 1)
    reach = 1
    for stride, size in dims:
        if stride < reach:
            return True
        reach = stride * size
    return False


def _identical(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(
            torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                  and torch.equal(a.nan_to_num(), b.nan_to_num())))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b if not isinstance(a, torch.Tensor) else False
