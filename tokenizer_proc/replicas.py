"""The tokenizer's links to the data-parallel replicas' schedulers.

One push socket per scheduler; every scheduler pushes back to the tokenizer's one pull
socket, tagging what it sends with its `dp_rank`. This holds mirrors only: the latest
`ServerInfo` and `SchedulerStats` each scheduler sent (refreshed by the manager's receive
task), merged for the parts of the API that speak of the server as one.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq.asyncio

from tokenizer_proc.router import ReplicaRouter
from trident.wire.frontend import SCHEDULER_STATS, SchedulerStats, ServerInfo
from trident.wire.server_args import ServerArgs
from trident.wire.transport import AsyncPushSocket, endpoint, scheduler_in_endpoint


class ReplicaSet:
    def __init__(self, zmq_ctx: zmq.asyncio.Context, args: ServerArgs) -> None:
        self.size = args.dp_size
        self.pushes = [
            AsyncPushSocket(zmq_ctx, endpoint(args.run_dir, scheduler_in_endpoint(d)), bind=False)
            for d in range(self.size)
        ]
        self.router = ReplicaRouter(self.size, args.load_balance_method)
        self.infos: list[ServerInfo | None] = [None] * self.size
        """Mirror: each scheduler's latest ServerInfo (a new boot_id = that scheduler restarted)."""
        self.stats: list[SchedulerStats | None] = [None] * self.size
        """Mirror: each scheduler's latest periodic stats."""

    def boot_id(self, replica: int) -> str:
        """The boot_id of `replica`'s scheduler as last announced, which addresses requests
        (GenerateReq.scheduler_boot_id); empty before its first ServerInfo."""
        info = self.infos[replica]
        return "" if info is None else info.boot_id

    async def send(self, replica: int, msg: Any) -> None:
        await self.pushes[replica].send(msg)

    async def broadcast(self, msg: Any) -> None:
        for push in self.pushes:
            await push.send(msg)

    def merged_info(self) -> ServerInfo | None:
        """The server as clients see it: the strictest limits, the summed capacity."""
        if any(i is None for i in self.infos):
            return None
        first = self.infos[0]
        return msgspec.structs.replace(
            first,
            context_length=min(i.context_length for i in self.infos),
            max_running_requests=sum(i.max_running_requests for i in self.infos),
            kv_total_tokens=sum(i.kv_total_tokens for i in self.infos),
        )

    def merged_stats(self) -> SchedulerStats | None:
        present = [s for s in self.stats if s is not None]
        if not present:
            return None
        fields = {}
        for name, stat in SCHEDULER_STATS.items():
            values = [getattr(s, name) for s in present]
            fields[name] = max(values) if stat.merge == "max" else sum(values)
        return SchedulerStats(**fields)

    def close(self) -> None:
        for push in self.pushes:
            push.close()
