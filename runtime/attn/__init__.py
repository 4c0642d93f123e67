"""The runtime's attention, one module per variant (``attn``: ``zeppelin.runtime.attention`` is the
public API's attention function, docs/API.md).

Layouts (runtime contract): ``q: [T, Hq, D]``, ``k, v: [T, Hkv, D]`` (GQA: ``Hq % Hkv == 0``),
sequences packed along T, causal within each sequence by ABSOLUTE token position, softmax scale
``1/sqrt(D)`` unless given. Log-sum-exp tensors are ``[Hq, T]`` float32 (natural log).

* :mod:`.local`      whole sequences on one rank (varlen kernels; :class:`.local.LocalPack`);
* :mod:`.blocks`     chunk-pair blocks of one sequence (the ring's unit of compute);
* :mod:`.ring`       ring attention over a group (zigzag or any ranges), forward and backward;
* :mod:`.transport`  the ring's P2P exchanges, following the plan's inter-node routes;
* :mod:`.ulysses`    Ulysses all-to-all head scatter over a group;
* :mod:`.merge`      the log-sum-exp merge of partial results every split variant uses;
* :mod:`.reference`  plain softmax attention, the ground truth of the tests;
* :mod:`.schedule`   what one rank runs for a plan's micro-batch, compiled without communication
                     (:class:`zeppelin.runtime.engine.AttentionEngine` executes it).

Kernels: :mod:`zeppelin.runtime.kernels` picks one per (device, dtype, block kind); its module
docstring holds the table.
"""
