"""The Zeppelin planner: hierarchical sequence partitioning, NIC routing and remapping.

``tiering``  cost crossovers that give each sequence its tier (local / intra-node / inter-node);
``assign``   the two-level (node, then GPU) packing, greedy with an ILP where it pays;
``routing``  splitting inter-node ring transfers over proxy GPUs' NICs;
``remap``    the minimum-communication transfer between the attention and the linear layout;
``planner``  the ``zeppelin`` planner and its ablations, which combine the above per step.
"""
