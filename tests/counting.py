"""CountingSamples: a request's samples that count the reads of them, for the tests that bound
what a step reads of a request of many samples (the scheduler's admission, the engine's
deltas)."""

from __future__ import annotations


class CountingSamples(list):
    """A request's samples that count the reads of them, by iteration or by index."""

    num_reads = 0

    def __iter__(self):
        for seq in super().__iter__():
            self.num_reads += 1
            yield seq

    def __getitem__(self, index):
        self.num_reads += 1
        return super().__getitem__(index)
