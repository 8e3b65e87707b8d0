"""A fleet of sandboxd nodes on Ray, sharing one PostgreSQL state database.

- `nodes`: one daemon per Ray node, owned by an actor pinned to that node (node affinity); the daemon
  dies with its actor, as it would with its machine.
- `keys`: the fleet's CURVE keys (node daemons on tcp:// admit only the door) and each daemon's config.
- `placement`: each session's Ray placement group, holding its sandbox's CPU and memory.
- `export`: snapshots exported to storage every node mounts, so a lost node's session can start again.
- `door`: the front door (`sandboxd fleet serve`): the daemon's protocol on one endpoint, each session
  placed by Ray's scheduler (a placement group holding the sandbox's CPU and memory) and every request
  routed to the node its session lives on; a node Ray reports dead has its sessions marked `lost`.

Ray is the `fleet` extra; nothing else in sandboxd imports this package.
"""
