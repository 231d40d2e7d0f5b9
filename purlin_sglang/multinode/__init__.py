"""Groups that span nodes: purlin inside each node, torch.distributed between nodes.

A :class:`~purlin_sglang.Communicator` whose group's ranks sit on several nodes (config
``topology.node_of_rank``, else the ranks' hosts) runs every collective in two levels
(:mod:`.communicator`): a stage inside each node on a purlin communicator of that node's ranks,
and a stage between nodes on a torch.distributed group of the ranks with the same local index
(:mod:`.cross`), NCCL on GPUs and gloo on CPUs. :mod:`.layout` names the ranks' places; the design,
orders and bytes are in docs/MULTINODE.md.
"""
