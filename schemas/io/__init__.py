"""The I/O floor of the contracts: everything that touches a file, below the documents themselves.

* :mod:`~zeppelin.schemas.io.safefiles` - the one home of file safety: inputs are regular files
  no output replaces, outputs are written atomically, managed directories never follow a link;
* :mod:`~zeppelin.schemas.io.signals` - SIGTERM/SIGHUP while writing become an exception, so the
  writer cleans up;
* :mod:`~zeppelin.schemas.io.documents` - JSON from untrusted files and spec documents;
* :mod:`~zeppelin.schemas.io.datasets` - dataset manifests (sample lengths and token ids), with
  the shard readers in :mod:`~zeppelin.schemas.io.readers` and :mod:`~zeppelin.schemas.io.jsonl`
  and the tokenizers in :mod:`~zeppelin.schemas.io.tokenizers`;
* :mod:`~zeppelin.schemas.io.stream` - plans written and read as a stream.

The package imports nothing itself: each module is imported by name.
"""
