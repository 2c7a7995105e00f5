"""Buffers kept per device and stream instead of allocated per call.

A small call's host time counts every allocation (2-4.5 us each on the GPU hosts measured). Some
buffers are only ever used inside one call's launches: an unread lse, the split-KV decoding's
partial results, the scratch Triton's launcher asks for tensor descriptors. The
launches of a stream run one after another, so the next call on that stream may reuse the bytes the
last one used (as the caching allocator would hand the freed block back to that stream); another
stream gets its own block. Under CUDA graph capture each request gets a fresh tensor from the graph's
pool (a graph may replay on another stream, and a kept block could be freed under a graph that
writes it), and a request over the block limit is allocated fresh (its call's time dwarfs the
allocation's).
"""

from __future__ import annotations

import torch

_MAX_STREAMS = 64  # streams come and go: a dict past this many is cleared
_MAX_VIEWS = 1024


class Kept:
    """One kind of kept buffer: a block of bytes per (device, stream), grown by doubling from
    ``minimum`` up to ``limit`` bytes, and a view of it kept per requested shape and dtype."""

    def __init__(self, limit: int = 8 << 20, minimum: int = 1 << 16):
        self.limit, self.minimum = limit, minimum
        self.blocks: dict = {}  # (device, stream) -> uint8 block
        self.views: dict = {}  # (shape, dtype, device, stream) -> a view of that stream's block

    @staticmethod
    def _fresh(shape, dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def __call__(self, shape, dtype, device) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` on ``device`` (a launch plan's allocation factory)."""
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return self._fresh(shape, dtype, device)
            stream = torch._C._cuda_getCurrentRawStream(device.index)
        else:
            stream = None
        key = (shape, dtype, device, stream)
        view = self.views.get(key)
        if view is not None:
            return view
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.limit:
            return self._fresh(shape, dtype, device)
        base = self.block(nbytes, device, stream)
        if len(self.views) >= _MAX_VIEWS:
            self.views.clear()
        view = self.views[key] = base[:nbytes].view(dtype).view(shape)
        return view

    def block(self, nbytes: int, device: torch.device, stream) -> torch.Tensor:
        """The uint8 block of ``device`` and ``stream`` (a raw stream handle, None on the CPU), of
        ``nbytes`` bytes or more (at most ``limit``: the caller allocates larger requests itself)."""
        base = self.blocks.get((device, stream))
        if base is None or base.numel() < nbytes:
            # a larger block for this stream: the views of the old one go (they hold it), and the old
            # block returns to its stream's pool, where no launch in flight reads it
            for k in [k for k in self.views if k[2] == device and k[3] == stream]:
                del self.views[k]
            if len(self.blocks) >= _MAX_STREAMS:
                self.blocks.clear()
                self.views.clear()
            size = max(nbytes, self.minimum, 0 if base is None else min(2 * base.numel(), self.limit))
            base = self.blocks[(device, stream)] = self._fresh(size, torch.uint8, device)
        return base
