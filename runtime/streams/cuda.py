"""The declared-stream API on real CUDA streams and events (works inside graph capture too).

MAIN is whatever stream is current when an op is issued (the capture stream while capturing).
`synchronize` joins every side stream back into main instead of blocking the host: that is legal
inside a capture, which must end with all forked streams joined. An optional jitter injector
(seeded GPU busy-waits before every event record and wait, also while capturing, in the spirit of
SGLang's cache_consistency_jitter) stretches each stream's timing so a missing join turns into a
visible race instead of a lucky one.
"""

from __future__ import annotations

import random

import torch

from runtime.streams.tasks import MAIN, Event, StreamExecutor, Task, Wait


class CudaStreamExecutor(StreamExecutor):
    def __init__(self, jitter_cycles: int = 0, seed: int = 0, record_program: bool = False) -> None:
        super().__init__(record_program)
        self.jitter_cycles = jitter_cycles
        self.rng = random.Random(seed)
        self._streams: dict[str, torch.cuda.Stream] = {}
        # CUDA events by id of the recorded `Event`; kept alive for as long as a captured graph
        # may refer to them (cleared only between eager steps).
        self._events: dict[int, torch.cuda.Event] = {}
        self._keep: list[Event] = []

    def stream(self, name: str) -> torch.cuda.Stream:
        if name == MAIN:
            return torch.cuda.current_stream()
        if name not in self._streams:
            self._streams[name] = torch.cuda.Stream()
        return self._streams[name]

    def _jitter(self, stream: torch.cuda.Stream) -> None:
        if self.jitter_cycles:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(self.rng.randint(0, self.jitter_cycles))

    def record(self, stream: str) -> Event:
        event = super().record(stream)
        cuda_event = torch.cuda.Event()
        target = self.stream(stream)
        self._jitter(target)
        cuda_event.record(target)
        self._events[id(event)] = cuda_event
        self._keep.append(event)  # pins id(event) while its CUDA event is in use
        return event

    def _on_wait(self, wait: Wait) -> None:
        target = self.stream(wait.stream)
        self._jitter(target)
        target.wait_event(self._events[id(wait.event)])

    def _on_submit(self, task: Task) -> None:
        with torch.cuda.stream(self.stream(task.stream)):
            task.fn()

    def _on_synchronize(self) -> None:
        for name in sorted(self._streams):
            self.join(name)
        if not torch.cuda.is_current_stream_capturing():
            self._events.clear()
            self._keep.clear()
