"""One rank of the launcher test: a gloo all_reduce across DC namespaces.

Prints the sum and, from rank 0, what every rank saw of its own network namespace: the source
address the kernel picks towards MASTER_ADDR (the DC's own address) and the interfaces there.
"""

import datetime
import os
import socket

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)

with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((os.environ["MASTER_ADDR"], 9))  # UDP connect sends nothing; it only routes
    src_addr = s.getsockname()[0]
ifaces = sorted(name for _, name in socket.if_nameindex())
seen = (rank, int(os.environ["HYBRIDEP_DC"]), int(os.environ["LOCAL_RANK"]), src_addr, ifaces)
gathered = [None] * world
dist.all_gather_object(gathered, seen)
print(f"rank={rank} world={world} sum={t.item():g}", flush=True)
if rank == 0:
    print(f"gathered={gathered!r}", flush=True)
dist.destroy_process_group()
