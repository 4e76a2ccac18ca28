"""A rank of a multi-card run: `python -m aviatorc.worker`.

    torchrun --standalone --nproc-per-node 4 -m aviatorc.worker ART --inputs feeds.npz --output out.npz

Under torchrun (RANK and WORLD_SIZE in the environment) every rank joins the gloo group; rank 0
runs the plan on the inputs as `aviatorc run` does (`Session(ART, world=N)`) and writes the
outputs; the other ranks serve it until it stops them. A `Session(ART, world=N)` spawns its
ranks 1..N-1 with this module too (`--rank R --world N --init tcp://...`, internal).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aviatorc.worker", description="a rank of a multi-card aviatorc run")
    parser.add_argument("artifact")
    parser.add_argument("--inputs", metavar="FEEDS.npz", help="rank 0 under torchrun: the graph inputs, by name")
    parser.add_argument("--output", metavar="OUT.npz", help="rank 0 under torchrun: where to write the outputs")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a rank may wait for another")
    parser.add_argument("--rank", type=int, help="(spawned by a Session) this rank")
    parser.add_argument("--world", type=int, help="(spawned by a Session) the number of ranks")
    parser.add_argument("--init", help="(spawned by a Session) the group's init method")
    parser.add_argument("--parent", type=int, help="(spawned by a Session) the driver's pid: exit when it is gone")
    args = parser.parse_args(argv)
    from aviatorc.backends.cluster import serve_rank

    if args.rank is not None:  # spawned by a Session's Cluster
        serve_rank(args.artifact, args.rank, args.world, init=args.init, timeout_s=args.timeout, parent=args.parent)
        return 0
    if "RANK" not in os.environ:
        parser.error("run under torchrun (RANK and WORLD_SIZE set), or use `aviatorc run --world N`")
    import torch.distributed as dist

    from aviatorc.backends.cluster import GROUP_TIMEOUT

    dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        serve_rank(args.artifact, rank, world, init=None, timeout_s=args.timeout)
        return 0
    from aviatorc.cli import main as cli_main

    command = ["run", args.artifact, "--world", str(world), "--timeout", str(args.timeout)]
    if args.inputs is None:
        parser.error("rank 0 needs --inputs FEEDS.npz")
    command += ["--inputs", args.inputs] + (["--output", args.output] if args.output else [])
    status = cli_main(command)
    if dist.is_initialized():
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
