"""A second process with a registered KV pool, for the two-process transfer tests: started with the
transfer mode as its argument (direct or staged), prints its pool descriptor as one JSON line, then
answers each stdin line until stdin closes:

- a JSON list [page ids, token count]: the digest of those pages;
- {"reserve": num_pages}: the offset of a new receive slot for that many pages (staged);
- {"receive": [offset, page ids]}: scatter that slot into those pages and free it, answers "ok";
- {"slots_in_use": null}: how many receive slots are held.

`raw_receiver` is the other kind of peer: a bare Mooncake engine with a shared-memory buffer
registered, for the test that stops the receiving process while a write is in flight.
"""

from __future__ import annotations

import json
import sys
from multiprocessing import shared_memory

import torch

from runtime.disagg.transfer import KVTransfer, kv_digest, tcp_engine

LAYERS, SLOTS, LATENT, INDEX, PAGE = 2, 64, 12, 4, 8


def pool() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((LAYERS, SLOTS, LATENT), float("nan")), torch.full((LAYERS, SLOTS, INDEX), float("nan")))


def answer(transfer: KVTransfer, command) -> object:
    if isinstance(command, list):
        pages, tokens = command
        return kv_digest(transfer.latent, transfer.index_keys, pages, PAGE, tokens)
    assert transfer.staging is not None
    if "reserve" in command:
        return transfer.staging.allocate(transfer.staged_bytes(command["reserve"]))
    if "receive" in command:
        offset, pages = command["receive"]
        transfer.receive_staged(offset, pages)
        transfer.staging.free(offset)
        return "ok"
    return transfer.staging.slots_in_use


def raw_receiver(shm_name: str, size: int, conn) -> None:
    """Register the shared-memory buffer `shm_name` with an engine of this process, send the engine's
    RPC port and the buffer's address through `conn`, and wait for a word on `conn` to exit."""
    shm = shared_memory.SharedMemory(name=shm_name)
    buffer = torch.frombuffer(shm.buf, dtype=torch.uint8)
    engine = tcp_engine()
    assert engine.register_memory(buffer.data_ptr(), size) == 0
    conn.send((engine.get_rpc_port(), buffer.data_ptr()))
    conn.recv()
    del buffer
    shm.close()


def main() -> None:
    latent, index_keys = pool()
    transfer = KVTransfer(latent, index_keys, PAGE, mode=sys.argv[1] if len(sys.argv) > 1 else "staged")
    print(json.dumps(transfer.descriptor().to_dict()), flush=True)
    for line in sys.stdin:
        print(json.dumps(answer(transfer, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
