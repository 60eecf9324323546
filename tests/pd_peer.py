"""A second process with a registered KV pool, for the two-process transfer test: prints its pool
descriptor as one JSON line, then answers each stdin line (a JSON list of page ids and a token count)
with the digest of those pages, until stdin closes."""

from __future__ import annotations

import json
import sys

import torch

from runtime.disagg.transfer import KVTransfer, kv_digest

LAYERS, SLOTS, LATENT, INDEX, PAGE = 2, 64, 12, 4, 8


def pool() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((LAYERS, SLOTS, LATENT), float("nan")), torch.full((LAYERS, SLOTS, INDEX), float("nan")))


def main() -> None:
    latent, index_keys = pool()
    transfer = KVTransfer(latent, index_keys, PAGE)
    print(json.dumps(transfer.descriptor().to_dict()), flush=True)
    for line in sys.stdin:
        pages, tokens = json.loads(line)
        print(kv_digest(latent, index_keys, pages, PAGE, tokens), flush=True)


if __name__ == "__main__":
    main()
