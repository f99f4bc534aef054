"""A training stream whose next steps are already on the device: XLA's prefetching device
loader (torch_xla's `ParallelLoader`, what `MpDeviceLoader` wraps) over the resumable
stream. While the device runs step n, one thread gathers step n+1's micro-batches and
another copies them to the device, so a step never waits on the host for its inputs.

The stream underneath runs ahead of training, so this wrapper keeps the position of the
last step handed out: that is what a checkpoint saves. A restore or a reshuffle stops
the threads, sets the stream back to that position, and the next step starts them again.
"""

from __future__ import annotations

import collections

from frugality import xla
from frugality.data.loader import TrainStream


class DevicePrefetchStream:
    """A `TrainStream` (same `next_step`, `state_dict`, `load_state_dict`, `reshuffle`,
    `epoch`) whose steps come back on the XLA device, `prefetch` steps read ahead."""

    def __init__(self, stream: TrainStream, prefetch: int = 2) -> None:
        self.stream = stream
        self.prefetch = prefetch
        self._handed_out = stream.state_dict()  # the position after the last step handed out
        self._ahead: collections.deque[dict] = collections.deque()  # the position after each read-ahead step
        self._steps = None
        self._close = None
        self._error: Exception | None = None

    def __getattr__(self, name: str):  # the stream's other attributes (sizes, samples) as they are
        return getattr(self.stream, name)

    def _read(self):
        while True:
            try:
                batches = self.stream.next_step()
            except Exception as e:  # noqa: BLE001 - raised again in the training thread, which would see only an end
                self._error = e
                return
            self._ahead.append(self.stream.state_dict())
            yield batches

    def next_step(self) -> list:
        if self._steps is None:
            self._steps, self._close = xla.parallel_loader(self._read(), self.prefetch)
        try:
            batches = next(self._steps)
        except StopIteration:
            error, self._error = self._error, None
            self.close()
            raise error or RuntimeError("the device loader stopped") from None
        self._handed_out = self._ahead.popleft()
        return list(batches)

    def close(self) -> None:
        """Stop the threads and set the stream back to the last step handed out."""
        if self._close is not None:
            self._close()
        self._steps = self._close = None
        self._ahead.clear()
        self.stream.load_state_dict(self._handed_out)

    @property
    def epoch(self) -> float:
        return self._handed_out["consumed_samples"] / len(self.stream.samples.train_ids)

    @property
    def consumed_samples(self) -> int:
        return self._handed_out["consumed_samples"]

    @property
    def reshuffles(self) -> list:
        return [tuple(r) for r in self._handed_out.get("reshuffles", [])]

    def state_dict(self) -> dict:
        return dict(self._handed_out)

    def load_state_dict(self, state: dict) -> None:
        self._handed_out = dict(state)
        self.close()

    def reshuffle(self, number: int) -> None:
        self.close()
        self.stream.reshuffle(number)
        self._handed_out = self.stream.state_dict()
