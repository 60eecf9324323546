"""Batches of encoded sessions: generated in worker processes, bucketed by length, padded.

Sessions are drawn from seeds TRAIN_SEED_BASE + i (never the evaluation range). Each group of
`bucket` batches is sorted by length before splitting, so padding stays small.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from runtime.train.corpus import TRAIN_SEED_BASE
from runtime.train.encode import Example, encode_seed


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, T] long, padded with pad_id
    valid: torch.Tensor  # [B, T] float, 1 for real tokens
    loss_mask: torch.Tensor  # [B, T] bool, assistant tokens (the targets of the loss)

    def to(self, device: str) -> Batch:
        return Batch(self.ids.to(device), self.valid.to(device), self.loss_mask.to(device))


def collate(examples: list[Example], pad_id: int) -> Batch:
    longest = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    valid = torch.zeros(len(examples), longest)
    mask = torch.zeros(len(examples), longest, dtype=torch.bool)
    for row, e in enumerate(examples):
        ids[row, :len(e.ids)] = torch.tensor(e.ids)
        valid[row, :len(e.ids)] = 1
        mask[row, :len(e.ids)] = torch.tensor(e.loss_mask)
    return Batch(ids, valid, mask)


def batches(tokenizer_path: str, batch_size: int, pad_id: int, seed: int, workers: int,
            bucket: int = 8) -> Iterator[Batch]:
    rng = random.Random(seed)
    seeds = ((TRAIN_SEED_BASE + seed * 10_000_000 + i, tokenizer_path) for i in itertools.count())
    group = batch_size * bucket

    def grouped(stream: Iterator[Example]) -> Iterator[Batch]:
        while True:
            examples = sorted(itertools.islice(stream, group), key=lambda e: len(e.ids))
            chunks = [examples[i:i + batch_size] for i in range(0, group, batch_size)]
            rng.shuffle(chunks)
            for chunk in chunks:
                yield collate(chunk, pad_id)

    if workers <= 0:
        yield from grouped(map(encode_seed, seeds))
        return
    with mp.get_context("fork").Pool(workers) as pool:
        yield from grouped(pool.imap(encode_seed, seeds, chunksize=64))
